"""Numerics of training: mixed precision (autocast and the float16 grad scaler, `mixed`) and
float8 Linears (`float8`, torchao).

May import `config` and `models`.
"""
