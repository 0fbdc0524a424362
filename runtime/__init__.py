"""picc's runtime: loads compiled models and runs them. It never imports the compiler (``picc``).

``session.Session`` opens a ``.pib`` and generates text; ``executor.Executor`` runs one step on the
CPU (``cpu``) and a GPU (``cuda``, or the host-emulated ``gpu``) stage by stage.
``text.TextCodec`` encodes text as the model's tokenizer does, and ``chat.render_chat`` turns chat
messages into a prompt with the chat template the ``.pib`` carries.
"""

from runtime.sampling import sample_next

__all__ = ["sample_next"]
