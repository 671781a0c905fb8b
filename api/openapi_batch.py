"""The `/v1/files` and `/v1/batches` part of `GET /openapi.json`
(api/openapi.py builds the document; batch/routes.py serves the routes)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from api.batch import (
    BatchCreateRequest,
    BatchList,
    BatchObject,
    FileDeleted,
    FileList,
    FileObject,
)

# The models whose JSON Schemas the operations refer to, and in which mode.
MODELS: list[tuple[type[BaseModel], Any]] = [
    (BatchCreateRequest, "validation"),
    (BatchObject, "serialization"),
    (BatchList, "serialization"),
    (FileObject, "serialization"),
    (FileList, "serialization"),
    (FileDeleted, "serialization"),
]

_WHY = {
    "400": "a field is missing, invalid or not supported, or the batch (or a running batch "
           "using the file) cannot do that now",
    "401": "the API key is missing or wrong (when the server requires one)",
    "404": "no such file or batch",
    "413": "the body is larger than the server's limit",
    "415": "the Content-Type is not the one the route takes",
    "500": "an internal error",
    "503": "the Ray Jobs API (the cluster's dashboard) cannot be reached",
}

_UPLOAD: dict[str, Any] = {
    "type": "object",
    "required": ["file", "purpose"],
    "additionalProperties": False,
    "properties": {"file": {"type": "string", "format": "binary"},
                   "purpose": {"type": "string", "enum": ["batch"]},
                   "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                   "expires_after[seconds]": {"type": "integer", "minimum": 3600,
                                              "maximum": 2592000}},
}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def _op(summary: str, ok: str, ok_content: dict[str, Any], errors: str,
        error_ref: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "summary": summary,
        **extra,
        "responses": {
            "200": {"description": ok, "content": ok_content},
            **{code: {"description": _WHY[code],
                      "content": {"application/json": {"schema": error_ref}}}
               for code in errors.split()},
        },
    }


def _path_param(name: str) -> list[dict[str, Any]]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]


def batch_paths(refs: dict[Any, dict[str, Any]], error_ref: dict[str, Any]
                ) -> dict[str, Any]:
    def json_of(model: type[BaseModel]) -> dict[str, Any]:
        return {"application/json": {"schema": refs[(model, "serialization")]}}

    create_ref = refs[(BatchCreateRequest, "validation")]
    return {
        "/v1/files": {
            "post": _op(
                "Upload a batch input file (JSONL, purpose `batch`)", "the File object",
                json_of(FileObject), "400 401 413 415 500", error_ref,
                requestBody={"required": True,
                             "content": {"multipart/form-data": {"schema": _UPLOAD}}}),
            "get": _op("Files, newest first unless `order` is `asc`", "a page of File objects",
                       json_of(FileList), "400 401 404 500", error_ref, parameters=[
                           _query("limit", {"type": "integer", "minimum": 1,
                                            "maximum": 10000}),
                           _query("order", {"type": "string", "enum": ["asc", "desc"]}),
                           _query("after", {"type": "string"}),
                           _query("purpose", {"type": "string"})]),
        },
        "/v1/files/{file_id}": {
            "get": _op("A file's File object", "the File object", json_of(FileObject),
                       "401 404 500", error_ref, parameters=_path_param("file_id")),
            "delete": _op("Delete a file (refused while a running batch uses it)",
                          "the file's deletion", json_of(FileDeleted), "400 401 404 500 503",
                          error_ref, parameters=_path_param("file_id")),
        },
        "/v1/files/{file_id}/content": {"get": _op(
            "A file's content (a batch's results: the lines written so far)", "the file",
            {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            "401 404 500", error_ref, parameters=_path_param("file_id"))},
        "/v1/batches": {
            "post": _op("Create a batch and start its Ray Job", "the Batch object",
                        json_of(BatchObject), "400 401 404 413 415 500 503", error_ref,
                        requestBody={"required": True,
                                     "content": {"application/json": {"schema": create_ref}}}),
            "get": _op("Batches, newest first", "a page of Batch objects", json_of(BatchList),
                       "400 401 404 500 503", error_ref, parameters=[
                           _query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                           _query("after", {"type": "string"})]),
        },
        "/v1/batches/{batch_id}": {"get": _op(
            "A batch's Batch object", "the Batch object", json_of(BatchObject),
            "401 404 500 503", error_ref, parameters=_path_param("batch_id"))},
        "/v1/batches/{batch_id}/cancel": {"post": _op(
            "Stop a batch's Ray Job (its results so far stay)", "the Batch object",
            json_of(BatchObject), "400 401 404 500 503", error_ref,
            parameters=_path_param("batch_id"))},
    }
