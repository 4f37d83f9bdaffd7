"""The operator's memo: an OperatorMemo as main.py passes it, or kopf's plain Memo from an embedder."""

from __future__ import annotations

import time

import kopf

from rlrun_operator.config import OperatorConfig
from rlrun_operator.memo import OperatorMemo, complete_memo, get_run_state


def test_a_plain_kopf_memo_gets_every_field_and_keeps_what_the_embedder_gave() -> None:
    config = OperatorConfig.from_env({})
    api = object()
    memo = kopf.Memo(api=api)
    complete_memo(memo, config)
    assert memo.api is api and memo.config is config
    assert memo.http is None and memo.clock is time.time and memo.run is None
    assert get_run_state(memo) is memo.run is not None  # created on first use, then kept


def test_an_operator_memo_is_left_as_it_is() -> None:
    config = OperatorConfig.from_env({})
    memo = OperatorMemo(config=config, clock=lambda: 5.0)
    complete_memo(memo, OperatorConfig.from_env({}, status_interval_s=1.0))
    assert memo.config is config and memo.clock() == 5.0
