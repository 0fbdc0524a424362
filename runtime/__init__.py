"""picc's runtime: loads compiled models and runs them. It never imports the compiler (``picc``).

``session.Session`` opens a ``.pib`` and generates text; ``executor.Executor`` runs one step on the
CPU (``cpu``) and a GPU (``cuda``, or the host-emulated ``gpu``) stage by stage.
"""

from runtime.sampling import sample_next

__all__ = ["sample_next"]
