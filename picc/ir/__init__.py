"""The picc IR: typed SSA ops over tensors, a text form that round-trips, and a verifier."""

from picc.ir import fused_ops, ops, sparse_ops
from picc.ir.core import OPS, Op, RuleError, Sym, Val
from picc.ir.module import Arg, Function, Module, WeightDecl
from picc.ir.parser import ParseError, parse
from picc.ir.printer import print_module
from picc.ir.types import DType, Placement, TensorType
from picc.ir.verifier import VerifyError, verify

__all__ = ["OPS", "Arg", "DType", "Function", "Module", "Op", "ParseError", "Placement", "fused_ops",
           "RuleError", "Sym", "TensorType", "Val", "VerifyError", "WeightDecl", "ops", "parse", "sparse_ops",
           "print_module", "verify"]
