"""Schemathesis fuzzes every operation of /openapi.json, bounded: no generated request may get a 5xx.

Driven through hypothesis directly: schemathesis's pytest plugin reads a private pytest attribute that pytest 9.2
removed.
"""

from __future__ import annotations

import time

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

EXAMPLES_PER_MODE = 100  # valid and invalid bodies each, per operation
TIME_CAP_S = 300.0  # for the whole run; examples past it are generated but not sent


def test_no_generated_request_gets_a_server_error(tiny_server):
    schema = schemathesis.openapi.from_url(f"{tiny_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize"}
    started = time.time()
    failures, sent = [], []
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES_PER_MODE,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,  # the same examples in every run: a failure in CI reproduces here
                database=None,
            )
            def call(case) -> None:
                if time.time() - started < TIME_CAP_S:
                    case.call_and_validate(base_url=tiny_server.url, checks=[not_a_server_error], timeout=60)
                    sent.append(case.operation.label)

            try:
                call()
            except Unsatisfiable:
                pass  # an operation without parameters has no invalid request to send
            except Exception as exc:  # keep going: report every operation that fails, not just the first
                failures.append(f"{op.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)
    assert sent.count("POST /v1/chat/completions") >= EXAMPLES_PER_MODE  # the cap left the run meaningful
    tiny_server.wait_idle(timeout=30)
