"""Request workloads shared by the benchmark and the response-length predictor.

sharegpt.py    ShareGPT V3 first exchanges and their token lengths
"""
