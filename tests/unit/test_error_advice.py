"""Every error text of ``gradring/errors.py``, built under each graph setting
(default, find_unused_parameters, static_graph): its advice never tells the
user to pass a setting they already have (``static_graph=True`` to a
static_graph DDP, ``find_unused_parameters=False`` to a default one, ...).

The table below gives each builder sample arguments; a builder added to
``errors.py`` without an entry fails the completeness test, so none is
left out. Builders that take ``static_graph`` / ``find_unused`` get the
setting in force; the others say the same under all three and are checked
under all three.
"""

from __future__ import annotations

import inspect
import re

import pytest

from gradring import errors

SETTINGS = {
    "default": {"static_graph": False, "find_unused_parameters": False},
    "find_unused_parameters": {"static_graph": False, "find_unused_parameters": True},
    "static_graph": {"static_graph": True, "find_unused_parameters": False},
    "static_graph+find_unused_parameters": {"static_graph": True,
                                            "find_unused_parameters": True},
}

NAMES = ["trunk.weight", "trunk.bias", "a.weight", "a.bias"]

#: builder -> (args, kwargs) of a typical call.
SAMPLES: dict[str, tuple[tuple, dict]] = {
    "param_count_mismatch": (([4, 2],), {}),
    "param_shape_mismatch": ((0, "w", "sizes", [2, 3], [3, 2], 1),
                             {"this_rank": 0, "mine": [3, 2]}),
    "param_order_mismatch": ((0, "a", "b", 1), {"this_rank": 0}),
    "unfinished_reduction": (({0: [2, 3], 1: [2]}, NAMES), {"world_size": 3}),
    "marked_twice": ((1, "trunk.bias"), {}),
    "static_graph_newly_used": ((2, "a.weight"), {}),
    "backward_twice": ((), {}),
    "meta_parameters": (("Net",), {}),
    "delay_all_reduce_half_given": ((), {}),
    "no_trainable_params": ((), {}),
    "mixed_devices": ((["cpu", "meta"],), {}),
    "not_initialized": (({},), {}),
    "bucket_context": ((0, 64, [0, 1], NAMES, 3), {}),
    "static_graph_too_late": ((), {}),
    "nothing_unused": ((), {}),
    "static_graph_twice": ((), {}),
    "static_graph_with_find_unused": ((), {}),
    "unsupported_argument": (("batched_grad_copy",), {}),
    "check_reduction_deprecated": ((), {}),
    "too_many_device_ids": ((), {}),
    "device_ids_on_cpu": (([0], None, {"cpu"}), {}),
    "auto_cap_without_rebuild": ((25,), {}),
    "bad_bucket_cap": ((float("nan"),), {}),
    "no_sync_with_fused_optim": ((), {}),
    "hook_not_callable": ((3,), {}),
    "comm_hook_twice": ((), {}),
    "torch_power_sgd_on_gloo": (("powerSGD_hook",), {}),
    "comm_hook_with_fused_optim": ((), {}),
    "fused_optim_twice": ((), {}),
    "fused_optim_with_comm_hook": ((), {}),
    "broadcast_buffers_deprecated": ((), {"both": True}),
    "torch_internal": (("_ddp_init_helper",), {}),
    "reducer_not_finalized": ((), {}),
    "in_backward_optim_with_hook": ((), {}),
    "buffer_hook_not_callable": ((3,), {}),
    "torch_sync_batchnorm_on_cpu": (("bn",), {}),
    "param_not_in_reducer": (("w",), {}),
    "param_mapping_incomplete": ((3, 4), {}),
}

#: Errors raised under some settings only (the others: under every setting).
ONLY_UNDER = {
    "static_graph_newly_used": lambda s: s["static_graph"],
    "static_graph_twice": lambda s: s["static_graph"],
    "static_graph_with_find_unused": lambda s: s["static_graph"] and s["find_unused_parameters"],
    "nothing_unused": lambda s: s["find_unused_parameters"] and not s["static_graph"],
    "auto_cap_without_rebuild": lambda s: s["find_unused_parameters"] and not s["static_graph"],
}

CASES = [(name, setting) for name in sorted(SAMPLES) for setting in SETTINGS
         if ONLY_UNDER.get(name, lambda s: True)(SETTINGS[setting])]

#: torch's own descriptive sentences, kept word for word, which state what the
#: user specified rather than advise it.
_DESCRIPTIVE = ("was specified in DDP constructor", "You passed find_unused_parameters")


def _builders() -> dict[str, object]:
    return {name: fn for name, fn in vars(errors).items()
            if inspect.isfunction(fn) and fn.__module__ == errors.__name__
            and not name.startswith("_")}


def _build(name: str, setting: dict[str, bool]) -> str:
    fn = _builders()[name]
    args, kwargs = SAMPLES[name]
    params = inspect.signature(fn).parameters
    kwargs = dict(kwargs)
    if "static_graph" in params:
        kwargs["static_graph"] = setting["static_graph"]
    if "find_unused" in params:
        kwargs["find_unused"] = setting["find_unused_parameters"]
    return fn(*args, **kwargs)


def _advice_naming(text: str, setting: dict[str, bool]) -> list[str]:
    """The sentences of ``text`` that name a setting as the user already has it."""
    bad = []
    for sentence in re.split(r"(?<=[.;:])\s+|\n", text):
        if any(d in sentence for d in _DESCRIPTIVE):
            continue
        for flag, value in setting.items():
            if re.search(rf"\b{flag}\s*=\s*{value}\b", sentence):
                bad.append(sentence)
    return bad


def test_every_builder_has_a_sample() -> None:
    assert sorted(_builders()) == sorted(SAMPLES)


@pytest.mark.parametrize("name, setting", CASES)
def test_advice_fits_the_settings_in_force(name: str, setting: str) -> None:
    text = _build(name, SETTINGS[setting])
    assert isinstance(text, str) and text
    assert _advice_naming(text, SETTINGS[setting]) == [], text


def test_the_check_can_fail() -> None:
    """The default advice of an unfinished reduction names find_unused_parameters=True:
    under that setting the check must object to it."""
    default = _build("unfinished_reduction", SETTINGS["default"])
    assert _advice_naming(default, SETTINGS["find_unused_parameters"])
    static = _build("marked_twice", SETTINGS["default"])
    assert _advice_naming(static, SETTINGS["static_graph"])


def test_static_graph_keeps_torch_sentence() -> None:
    for count in (0, 2):
        text = errors.static_graph_newly_used(1, "trunk.bias", first_count=count)
        assert text.startswith("Your training graph has changed in this iteration")
        assert "not compatible with static_graph set to True" in text
