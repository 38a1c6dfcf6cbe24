"""Errors a caller can fix: each names the parameter at fault (the server maps it to HTTP 400)."""

from __future__ import annotations


class InvalidParameter(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def invalid_value(name: str, value: object, allowed: str) -> InvalidParameter:
    return InvalidParameter(name, f"{name}={value!r} is invalid: must be {allowed}")
