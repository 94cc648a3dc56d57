import time

from pydantic import BaseModel, Field

from orchestrator.verifiers_adapter import pydantic_defaults


class Node(BaseModel):
    token_ids: list[int] = Field(default_factory=list)
    timestamp: float = Field(default_factory=time.time)
    size: int = Field(default_factory=lambda data: len(data["token_ids"]))  # takes the validated data


def test_model_construct_fills_defaults_as_before_and_checks_each_factory_once(monkeypatch):
    from pydantic._internal import _fields

    assert _fields.takes_validated_data_argument is pydantic_defaults.takes_validated_data_argument
    checked = []
    original = pydantic_defaults._check
    monkeypatch.setattr(pydantic_defaults, "_check", lambda factory: checked.append(factory) or original(factory))
    pydantic_defaults._cached.cache_clear()
    before = time.time()
    nodes = [Node.model_construct(token_ids=[1, 2, 3]) for _ in range(50)] + [Node.model_construct() for _ in range(50)]
    assert [n.size for n in nodes] == [3] * 50 + [0] * 50  # the factory that takes the validated data still gets it
    assert all(n.timestamp >= before for n in nodes)
    assert nodes[50].token_ids == [] and nodes[50].token_ids is not nodes[51].token_ids  # a fresh list each time
    assert len(checked) == 3  # list, time.time and the lambda: once each, not once per model


def test_an_unhashable_factory_is_checked_every_time():
    class Factory:
        __hash__ = None

        def __call__(self):
            return 1

    assert pydantic_defaults.takes_validated_data_argument(Factory()) is False
