"""How much each FFN neuron's gate activation matters to the loss: per-neuron Fisher scales.

Gate-first sparsity skips neuron i of a GLU FFN when its gate activation ``a_i = act(g_i)`` is
small. CATS compares ``|a_i|`` with one threshold per layer at the same sparsity in every layer,
which treats a neuron of a layer whose output barely moves the loss like one of a layer that
moves it a lot, and a neuron with a tiny up projection or down column like one with large ones.
Skipping ``a_i`` changes the loss by about ``0.5 * a_i^2 * E[(dL/da_i)^2]`` (a second-order
expansion with the Fisher information as the curvature), so the score ``|a_i| * s_i`` with
``s_i = sqrt(E[(dL/da_i)^2])`` ranks (token, neuron) pairs of *all* layers on one scale: a single
threshold across layers then spends the sparsity where it costs least.

``dL/da_i = u_i * (down_i . dL/dy)`` needs the gradient of the loss, so this module runs the dense
``forward`` in torch (autograd) on the calibration windows, with labels sampled from the model's
own next-token distribution (the true Fisher, not the empirical one: it measures the model's
sensitivity, not its fit to the corpus). The torch forward follows the interpreter op by op;
``tests/test_fisher.py`` checks its logits against the interpreter's.

The pass runs decoder block by decoder block over all the calibration windows (as profiling's
``Interpreter.run_many`` does), keeping only each block's inputs: forward through every block,
then backward from the loss one block at a time, recomputing the block's forward from its saved
inputs (checkpointing). The weights are read through ``WeightStore.f32``'s cache, bounded for the
pass to the largest block's float32 weights, and never copied, so at any time the float32 weights
alive are about one block's (a LLaMA-7B block: 0.8 GB), not the model's (27 GB), at the cost of
computing each block's forward twice. The forward pass also hands every FFN's scores to an
observer (``on_ffn``): the profile under the ``fisher`` rule is taken there
(``picc.sparsity.profiling.calibrate``), not in a forward pass of its own.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from picc.errors import PiccError
from picc.interpreter import FfnTrace, round_to_bf16
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.module import Module
from picc.ir.weights import WeightStore
from picc.sparsity.calib import Windows


class TorchForward:
    """The dense ``forward`` of ``module`` on one window of tokens at positions 0..n-1, in torch.

    ``run`` returns the logits; ``gate_acts`` then holds each gated FFN's ``act(gate)`` [seq,
    n_ff], kept in the graph so that ``.grad`` is filled by a backward pass. ``on_ffn``, when set,
    sees each ffn op's activity scores and ``h`` as the interpreter's ``on_ffn`` does.
    """

    def __init__(self, module: Module, weights: WeightStore) -> None:
        import torch

        self.torch = torch
        self.func = module.function()
        self.weights = weights
        self.gate_acts: dict[str, torch.Tensor] = {}
        self.on_ffn: Callable[[FfnTrace], None] | None = None

    def w(self, name: str):  # noqa: ANN201 - torch.Tensor (torch is imported lazily)
        # The store's own float32 array, not a copy: alive while the store's bounded cache or a
        # graph being run holds it, never for the whole model at once.
        array = self.weights.f32(name)
        with warnings.catch_warnings():  # a read-only (mapped) array: torch warns, nothing writes it
            warnings.simplefilter("ignore", UserWarning)
            return self.torch.from_numpy(array)

    def run(self, tokens: list[int]):  # noqa: ANN201 - torch.Tensor
        torch = self.torch
        n = len(tokens)
        env = {"tokens": torch.tensor(tokens, dtype=torch.long), "pos": torch.arange(n)}
        self.gate_acts = {}
        for op in self.func.ops:
            env[op.result] = self.eval(op, env)
        return env[self.func.ret]

    def eval(self, op: Op, env: dict) -> object:  # noqa: C901 - one case per op
        torch, w = self.torch, self.w
        match op:
            case O.Embed():
                # A leaf that needs a gradient, so the graph records everything after it.
                rows = w(op.table)[env[op.tokens]] * op.scale
                return rows.requires_grad_() if torch.is_grad_enabled() else rows
            case O.PosEmbed():
                return w(op.table)[env[op.pos] + op.offset]
            case O.RMSNorm():
                x = env[op.x]
                x = x.reshape(*x.shape[:-1], -1, op.group) if op.group else x
                y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + op.eps) * w(op.weight)
                return y.reshape(env[op.x].shape)
            case O.LayerNorm():
                x = env[op.x]
                bias = w(op.bias) if op.bias else None
                return torch.nn.functional.layer_norm(x, x.shape[-1:], w(op.weight), bias, op.eps)
            case O.Linear():
                y = env[op.x] @ w(op.weight).T
                return y + w(op.bias) if op.bias else y
            case O.Rope():
                return self.rope(op, env[op.x], env[op.pos])
            case O.ConcatHeads():
                return self.concat_heads(op, env[op.a], env[op.b])
            case O.Attention():
                return self.attention(op, env[op.q], env[op.k], env[op.v])
            case O.Relu() | O.Silu() | O.Gelu() | O.GeluTanh():
                return self.activation(op.NAME, env[op.x])
            case O.Softcap():
                return self.torch.tanh(env[op.x] / op.cap) * op.cap
            case O.Add():
                return env[op.a] + env[op.b]
            case O.Mul():
                return env[op.a] * env[op.b]
            case O.FFN():
                return self.ffn(op, env[op.x])
            case O.MoE():
                return self.moe(op, env[op.x])
        raise PiccError(f"Fisher scales: op {op.NAME!r} (%{op.result}) has no torch forward; "
                        "run them before sparsifying passes")

    def activation(self, name: str, x):  # noqa: ANN001, ANN201 - torch.Tensor
        f = self.torch.nn.functional
        if name == "relu":
            return f.relu(x)
        if name == "silu":
            return f.silu(x)
        if name == "gelu":
            return f.gelu(x)
        if name == "gelu_tanh":
            return 0.5 * x * (1 + self.torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
        raise NotImplementedError(name)

    def rope(self, op: O.Rope, x, pos):  # noqa: ANN001, ANN201 - torch.Tensor
        torch = self.torch
        seq, r = x.shape[0], op.rotated
        heads = x.reshape(seq, op.n_heads, op.head_dim)
        angles = pos.to(torch.float32)[:, None] * torch.from_numpy(op.inv_freq())[None, :]
        scale = float(op.attention_factor)
        cos, sin = torch.cos(angles)[:, None, :] * scale, torch.sin(angles)[:, None, :] * scale
        part = heads[..., :r]
        if op.style == "llama":
            a, b = part[..., : r // 2], part[..., r // 2 :]
            rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            a, b = part[..., 0::2], part[..., 1::2]
            rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).reshape(part.shape)
        return torch.cat([rotated, heads[..., r:]], dim=-1).reshape(seq, -1)

    def concat_heads(self, op: O.ConcatHeads, a, b):  # noqa: ANN001, ANN201 - torch.Tensor
        seq = a.shape[0]
        parts = [x.reshape(seq, -1, dim).expand(seq, op.n_heads, dim) for x, dim in ((a, op.a_dim), (b, op.b_dim))]
        return self.torch.cat(parts, dim=-1).reshape(seq, -1)

    def attention(self, op: O.Attention, q, k, v):  # noqa: ANN001, ANN201 - torch.Tensor
        torch = self.torch
        seq, d, dv = q.shape[0], op.head_dim, op.v_dim
        group = op.n_heads // op.n_kv_heads
        qh = q.reshape(seq, op.n_heads, d).transpose(0, 1)
        kh = k.reshape(seq, op.n_kv_heads, d).transpose(0, 1).repeat_interleave(group, dim=0)
        vh = v.reshape(seq, op.n_kv_heads, dv).transpose(0, 1).repeat_interleave(group, dim=0)
        scores = qh @ kh.transpose(1, 2)
        if op.alibi == "falcon":  # as the interpreter: bf16(bf16(slope_h) * j), before the scale
            slopes = round_to_bf16(op.alibi_slopes())
            bias = round_to_bf16(slopes[:, None] * np.arange(seq, dtype=np.float32)[None, :])
            scores = scores + torch.from_numpy(bias)[:, None, :]
        scores = scores * op.scale
        if op.softcap is not None:
            scores = torch.tanh(scores / op.softcap) * op.softcap
        i = torch.arange(seq)
        visible = i[None, :] <= i[:, None]
        if op.window is not None:
            visible &= i[:, None] - i[None, :] < op.window
        scores = scores.masked_fill(~visible, float("-inf"))
        if op.sinks is not None:  # gpt-oss: a logit per head in the softmax, dropped after it
            sinks = self.w(op.sinks).reshape(-1, 1, 1).expand(-1, seq, 1)
            out = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1] @ vh
        else:
            out = torch.softmax(scores, dim=-1) @ vh
        return out.transpose(0, 1).reshape(seq, op.n_heads * dv)

    def moe(self, op: O.MoE, x):  # noqa: ANN001, ANN201 - torch.Tensor
        """The interpreter's mixture (the experts' neurons are not scored: not an ``ffn``)."""
        torch, w = self.torch, self.w

        def bias(name: str | None, part: slice | None = None):  # noqa: ANN202 - torch.Tensor or 0
            return 0.0 if name is None else w(name) if part is None else w(name)[part]

        logits = x @ w(op.router).T + bias(op.router_bias)
        routed = logits[:, : op.n_experts]
        probs = torch.sigmoid(routed) if op.scoring == "sigmoid" else torch.softmax(routed, dim=-1)
        scores = probs + bias(op.choice_bias)  # what ranks the experts (the same order as the logits' otherwise)
        if op.n_group > 1:  # only the topk_group best groups' experts
            members = scores.view(x.shape[0], op.n_group, -1).topk(2 if op.group_score == "top2" else 1, dim=-1)[0]
            best = torch.topk(members.sum(dim=-1), op.topk_group, dim=-1).indices
            eligible = torch.zeros(x.shape[0], op.n_group, dtype=torch.bool).scatter_(1, best, True)
            scores = scores.masked_fill(~eligible.repeat_interleave(op.n_experts // op.n_group, dim=1), float("-inf"))
        chosen = torch.topk(scores, op.top_k, dim=-1).indices
        weights = torch.gather(probs, 1, chosen)
        if op.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * op.routed_scale
        shared = torch.sigmoid(logits[:, op.n_experts]) if op.shared_gated else torch.ones(x.shape[0], dtype=x.dtype)
        weights = torch.cat([weights, shared[:, None].expand(-1, op.n_shared)], dim=1)
        shared_experts = torch.arange(op.n_experts, op.n_experts + op.n_shared).expand(x.shape[0], -1)
        chosen = torch.cat([chosen, shared_experts], dim=1)
        up, down = w(op.up), w(op.down)
        gate = w(op.gate) if op.gate else None
        n_ff, hidden = up.shape[0] // (op.n_experts + op.n_shared), x.shape[1]
        rows = []
        for s in range(x.shape[0]):
            y = torch.zeros(hidden, dtype=x.dtype)
            for weight, e in zip(weights[s], chosen[s].tolist(), strict=True):
                part, out = slice(e * n_ff, (e + 1) * n_ff), slice(e * hidden, (e + 1) * hidden)
                u = up[part] @ x[s] + bias(op.up_bias, part)
                g = gate[part] @ x[s] + bias(op.gate_bias, part) if gate is not None else None
                if op.swiglu_limit is not None:
                    g, u = g.clamp(max=op.swiglu_limit), u.clamp(-op.swiglu_limit, op.swiglu_limit)
                    h = g * torch.sigmoid(op.swiglu_alpha * g) * (u + 1)
                else:
                    h = self.activation(op.spec.act, u) if g is None else (
                        self.activation(op.spec.act, g) * (self.activation(op.spec.act, u) if op.spec.act_on_up else u))
                y = y + weight * (down[out] @ h + bias(op.down_bias, out))
            rows.append(y)
        return torch.stack(rows)

    def ffn(self, op: O.FFN, x):  # noqa: ANN001, ANN201 - torch.Tensor
        w = self.w
        up = x @ w(op.up).T
        if op.up_bias:
            up = up + w(op.up_bias)
        if not op.spec.gated:
            h = score = self.activation(op.spec.act, up)
        else:
            assert op.gate is not None
            gate = x @ w(op.gate).T
            if op.gate_bias:
                gate = gate + w(op.gate_bias)
            act = self.activation(op.spec.act, gate)
            if act.requires_grad:
                act.retain_grad()
            self.gate_acts[op.result] = act
            h = act * (self.activation(op.spec.act, up) if op.spec.act_on_up else up)
            score = h if op.spec.act_on_up else act
        if self.on_ffn is not None:  # the interpreter's activity scores (picc.ir.ops.FFN)
            self.on_ffn(FfnTrace(op, x.detach().numpy(), score.detach().abs().numpy(), h.detach().numpy(), None))
        y = h @ (w(op.down) if op.neuron_major else w(op.down).T)
        return y + w(op.down_bias) if op.down_bias else y


def fisher_scales(module: Module, weights: WeightStore, windows: Windows, seed: int,
                  progress: Callable[[int], None] | None = None,
                  on_ffn: Callable[[FfnTrace], None] | None = None,
                  tokens: int | None = None) -> dict[str, np.ndarray]:
    """``s_i = sqrt(E[(dL/da_i)^2])`` of every gated FFN's neurons over ``windows``, by FFN name.

    L is the cross-entropy of each window's next-token predictions against labels sampled (with
    ``seed``) from the model's own distribution, window by window in order; the mean is over the
    tokens of the windows whose gradients are taken: the first that hold ``tokens`` (all by
    default; the scales of fewer are the same sums, stopped earlier). Block by block with
    checkpoints (the module's docstring); ``progress`` gets shares of the windows' tokens (the
    forward pass's share, then the backward's: one and two forwards per window they run).
    ``on_ffn`` sees every ffn op's scores and ``h`` (:class:`TorchForward`) once for each window,
    each layer's windows in order: what profiling needs, without a forward pass of its own.
    """
    forward = TorchForward(module, weights)
    func = forward.func
    segments = _segments(func.ops)
    inputs = _segment_inputs(func, segments)
    # Each block's weights are read for every window, then not until the backward pass comes back
    # to it: the store need keep no more than the largest block's float32 weights.
    block_bytes = max(sum(4 * math.prod(weights[name].shape) for op in func.ops[start:end] for name in op.weights())
                      for start, end in segments)
    with weights.f32_budget(max(block_bytes, 1)):
        return _fisher_scales(forward, segments, inputs, windows, seed, progress, on_ffn, tokens)


def _fisher_scales(forward: TorchForward, segments: list[tuple[int, int]], inputs: list[list[str]], windows: Windows,
                   seed: int, progress: Callable[[int], None] | None, on_ffn: Callable[[FfnTrace], None] | None,
                   tokens: int | None) -> dict[str, np.ndarray]:
    import torch

    func = forward.func
    sizes = [len(w) for w in windows.windows]
    graded = len(sizes) if tokens is None else max(1, int(np.searchsorted(np.cumsum(sizes), tokens)) + 1)
    graded = min(graded, len(sizes))
    n_tokens, n_graded = sum(sizes), sum(sizes[:graded])
    work = n_tokens + 2 * n_graded  # in forwards of one token
    forward_step = n_tokens / max(1, len(segments) - 1) * n_tokens / work  # the forward pass stops before the last
    backward_step = n_tokens * 2 * n_graded / work / len(segments)
    last_has_ffn = any(isinstance(op, O.FFN) for op in func.ops[segments[-1][0]:])
    # Forward, without a graph: each block's inputs, for the windows whose gradients are taken.
    envs = [{"tokens": torch.tensor(list(w), dtype=torch.long), "pos": torch.arange(len(w))}
            for w in windows.windows]
    saved: list[list[dict]] = []
    forward.on_ffn = on_ffn  # every op runs here once for each window (the last segment's: below)
    with torch.no_grad():
        for (start, end), names, after in zip(segments, inputs, inputs[1:], strict=False):
            saved.append([{name: env[name] for name in names} for env in envs[:graded]])
            envs = [{name: v for name, v in _run(forward, func.ops[start:end], env).items() if name in after}
                    for env in envs]
            if progress:
                progress(forward_step)
        saved.append([{name: env[name] for name in inputs[-1]} for env in envs[:graded]])
        if last_has_ffn and on_ffn is not None:  # (ops without blocks: one segment) observed here
            for env in envs:
                _run(forward, func.ops[segments[-1][0]:], env)
    del envs
    forward.on_ffn = None
    # Backward, from the loss down: each block's forward again from its inputs, with a graph.
    generator = torch.Generator().manual_seed(seed)
    sums: dict[str, torch.Tensor] = {}
    grads: list[dict] = [{} for _ in range(graded)]
    for s in reversed(range(len(segments))):
        start, end = segments[s]
        for w, grad_out in enumerate(grads):
            leaves = {name: v.detach().requires_grad_() if v.is_floating_point() else v
                      for name, v in saved[s][w].items()}
            env = _run(forward, func.ops[start:end], dict(leaves))
            if s == len(segments) - 1:
                logits = env[func.ret]
                with torch.no_grad():
                    labels = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]
                torch.nn.functional.cross_entropy(logits, labels, reduction="sum").backward()
            else:
                outs = [(env[name], g) for name, g in grad_out.items() if env[name].requires_grad]
                if outs:
                    torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
            for name, act in forward.gate_acts.items():
                assert act.grad is not None
                sq = (act.grad.double() ** 2).sum(0)
                sums[name] = sums[name] + sq if name in sums else sq
            grads[w] = {name: v.grad for name, v in leaves.items() if v.is_floating_point() and v.grad is not None}
            forward.gate_acts = {}
        saved[s] = []
        if progress:
            progress(backward_step)
    if not sums:
        raise PiccError("Fisher scales need gated FFNs (GLU forms); this model has none")
    return {name: np.sqrt(s.numpy() / n_graded).astype(np.float32) for name, s in sums.items()}


def _run(forward: TorchForward, ops: Sequence[Op], env: dict) -> dict:
    forward.gate_acts = {}
    for op in ops:
        env[op.result] = forward.eval(op, env)
    return env


def _segments(ops: Sequence[Op]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of consecutive ops of one decoder block (or of none)."""
    starts = [i for i, op in enumerate(ops) if i == 0 or op.block != ops[i - 1].block]
    return list(zip(starts, [*starts[1:], len(ops)], strict=True))


def _segment_inputs(func, segments: list[tuple[int, int]]) -> list[list[str]]:  # noqa: ANN001 - a Function
    """Per segment, the values it starts from: defined before it (or arguments) and used in it or
    after it (the return value counts as used after the last)."""
    defined = {a.name: -1 for a in func.args} | {op.result: i for i, op in enumerate(func.ops)}
    last_use: dict[str, int] = {func.ret: len(func.ops)}
    for i, op in enumerate(func.ops):
        for name in op.values():
            last_use[name] = max(last_use.get(name, -1), i)
    return [[name for name, i in defined.items() if i < start and last_use.get(name, -1) >= start]
            for start, _ in segments]
