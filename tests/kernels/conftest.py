"""Kernel tests run on CUDA; those marked `interpreter` also on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, see tests/conftest.py), with the fixes below."""
import pytest
import torch

from conveyor.kernels import interpreting


@pytest.fixture
def device() -> str:
    """Where the kernels run: CUDA, or the CPU under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _fix_interpreter() -> None:
    """Works around four bugs of Triton 3.5's interpreter that these kernels meet:
    - `range` over a scalar tensor (a loop with runtime bounds) calls int() on a one-element
      array, which NumPy 2.4 refuses;
    - tl.dot multiplies bfloat16 operands as their raw uint16 bits (and the interpreter's
      bfloat16 -> float32 conversion loses subnormals);
    - float32 -> bfloat16 casts truncate, where the GPU rounds to nearest even;
    - float32 -> float8 e4m3 casts truncate (0.3 becomes 0.28125, not 0.3125), where the GPU
      rounds to nearest even, as torch does.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor):
        patch_tensor(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    interpreter._patch_lang_tensor = patch_lang_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot

    def as_float(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        # through torch: the interpreter's own conversion gets subnormals wrong (2^-127 to 0)
        data = torch.from_numpy(h.data.view(np.int16)).view(torch.bfloat16).float().numpy()
        return interpreter.TensorHandle(data, tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, as_float(a), as_float(b), d, input_precision,
                          max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = dot
    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(src.data).to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(data.view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    _fix_interpreter_8bit(interpreter, tl, np)


def _fix_interpreter_8bit(interpreter, tl, np) -> None:
    """Two more, met by the weight-quantized kernels: integer -> bfloat16 casts store the
    integers' values as raw bfloat16 bits, and float -> fp8 (e4m3) casts round differently
    from the GPU (and torch), which round to nearest even. Both go through torch here."""
    cast = interpreter.InterpreterBuilder.cast_impl
    fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def to_fp8(src, dst_type):
        data = torch.from_numpy(src.data.astype(np.float32)).to(torch.float8_e4m3fn)
        return interpreter.TensorHandle(data.view(torch.uint8).numpy(), tl.float8e4nv)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar.is_int() and dst_type.scalar == tl.bfloat16:
            src = interpreter.TensorHandle(src.data.astype(np.float32), tl.float32)
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return to_fp8(src, dst_type)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return to_fp8(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


if interpreting() and not torch.cuda.is_available():
    _fix_interpreter()
