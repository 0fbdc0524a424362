"""picc's runtime: loads compiled models and runs them. It never imports the compiler (``picc``).

The executors (CPU through generated kernels, CUDA through TVM, a host-emulated GPU) arrive with
the code generation work; today the runtime holds what both sides share: sampling.
"""

from runtime.sampling import sample_next

__all__ = ["sample_next"]
