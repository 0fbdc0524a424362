"""Load SmolLM2 into picc IR, look at one layer of it, and greedily continue a prompt.

    .venv/bin/python examples/inspect_smollm2.py "The capital of France is"
"""

from __future__ import annotations

import sys

from picc.frontend import load_model
from picc.generate import generate_ids
from picc.ir import print_module, verify


def main() -> None:
    prompt = sys.argv[1] if len(sys.argv) > 1 else "The capital of France is"
    model = load_model("smollm2")
    verify(model.module)
    text = print_module(model.module)
    layer0 = [line for line in text.splitlines() if line.strip().startswith("%l0.")]
    print(f"{model.module.name}: {len(model.module.weights)} weights, "
          f"{sum(1 for _ in model.module.ops())} ops; layer 0:")
    print("\n".join(layer0))
    ids = model.tokenizer.encode(prompt)
    new = list(generate_ids(model, ids, 16))
    print(f"\n{prompt}{model.tokenizer.decode(new)}")


if __name__ == "__main__":
    main()
