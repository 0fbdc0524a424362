"""``dce``: remove ops whose results nothing reads, and weights no op reads.

Needs: a verified module. Guarantees: every remaining op contributes to the returned value; the
weight table lists only weights some op reads. Dropping an unread attention op also drops its KV
cache, which only that op could have read.
"""

from __future__ import annotations

from dataclasses import replace

from picc.ir.module import Module
from picc.passes.registry import PassContext, register_pass


@register_pass("dce")
def dce(module: Module, ctx: PassContext) -> Module:
    """Remove ops whose results are never read, and weights no op reads."""
    funcs = tuple(f.pruned() for f in module.functions)
    return replace(module, functions=funcs).with_used_weights_only()
