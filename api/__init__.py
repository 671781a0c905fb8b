"""What the deployments speak: the application's configuration schema, the
OpenAI-compatible protocol, the messages between deployments, HTTP
hardening and errors.

It sits below `deployments/` and imports nothing above itself (no
`deployments`, no `app`), so a deployment, the benchmark or a test can use
these schemas without pulling in the application.
"""
