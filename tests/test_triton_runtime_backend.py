"""The python models' one error policy (qvl_trt/triton/runtime/backend.py)."""

from __future__ import annotations

from qvl_trt.errors import InputError


def test_a_user_error_reaches_the_client_and_a_bug_only_by_its_type(caplog) -> None:
    from qvl_trt.triton.runtime.backend import guarded

    def refuse(text):
        raise InputError(f"{text} is too long; shorten it")

    def crash(text):
        return {}[text]

    sent: list[str] = []
    guarded("b4_preprocessing", sent.append, refuse, "prompt")
    assert sent == ["invalid request: prompt is too long; shorten it"] and not caplog.records
    guarded("b4_preprocessing", sent.append, crash, "secret")
    assert sent[1] == "internal error in b4_preprocessing: KeyError"
    assert "secret" not in sent[1]
    (record,) = caplog.records
    assert record.exc_info[0] is KeyError and "b4_preprocessing" in record.getMessage()
    assert guarded("b4_preprocessing", sent.append, str.upper, "fine") == "FINE"
    assert len(sent) == 2
