"""Page copies on the GPU's copy engines: one driver call for a whole batch of chunks.

`cuMemcpyBatchAsync` (CUDA 12.8+) takes arrays of (destination, source, size) and runs the
copies on the copy engines, in stream order, with no SM in use. For (page, layer) chunks of
64 KiB and more it moves scattered pages between pinned host memory and the device at the
link's contiguous rate, faster than SM loads, and the forward pass it overlaps keeps every
SM. For small chunks the per-copy cost of the engines dominates, so `TransferEngine` uses
the Triton kernels there. Measured by benchmarks/bench_copy_engine.py (the ratio of each to
a contiguous pinned copy); the figures are in docs/performance.md.

The driver spends CPU time per copy in a batch, during which the caller queues nothing
else. Pages of one load often sit in runs (consecutive host ids against
consecutive device ids: a prefix backed up in order, loaded into pages allocated together);
a run's layer is one strided copy, `copy_2d` (`cuMemcpy2DAsync`: a row per page, the host
pool's page stride apart), so a load costs the driver a call per run and layer instead of a
copy per page and layer. `page_runs` finds the runs.

The driver calls only enqueue (microseconds), so they keep the GIL (`ctypes.PyDLL`): with
ctypes' default, each call let the GIL go and waited to take it back, which cost a load
many times its CPU time while an L3 read's threads ran Python (bench_engine's 32K L3 hit;
docs/performance.md).

The entry points are found in libcuda at run time through ctypes: CUDA 13's
`cuMemcpyBatchAsync_v2`, else 12.8's `cuMemcpyBatchAsync` (which also reports a failing
index), and `cuMemcpy2DAsync_v2`. Where the batch call does not exist (an older driver, no
GPU), `BatchCopier.load()` returns None.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

# Chunks at least this large go to the copy engines (see the module docstring).
MIN_CHUNK_BYTES = 64 * 1024

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE


class _MemLocation(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_MEMORYTYPE_UNIFIED = 4  # CU_MEMORYTYPE_UNIFIED: pointers in the unified address space


class _Memcpy2D(ctypes.Structure):  # CUDA_MEMCPY2D
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


class CopyEngineError(RuntimeError):
    """The driver refused a batched copy (the CUresult is in the message)."""


class BatchCopier:
    """Issues batches of copies with `cuMemcpyBatchAsync` on a given CUDA stream."""

    _instance: BatchCopier | None = None
    _probed = False

    def __init__(self, function, reports_fail_index: bool, function_2d=None) -> None:
        self._function = function
        self._reports_fail_index = reports_fail_index
        self._function_2d = function_2d
        self._attrs = _MemcpyAttributes(
            _SRC_ACCESS_ORDER_STREAM,
            _MemLocation(0, 0),
            _MemLocation(0, 0),
            _FLAG_PREFER_OVERLAP_WITH_COMPUTE,
        )
        self._attr_index = (ctypes.c_size_t * 1)(0)

    @classmethod
    def load(cls) -> BatchCopier | None:
        """The process's copier, or None when the driver has no batched copy."""
        if not cls._probed:
            cls._probed = True
            cls._instance = cls._from_driver()
        return cls._instance

    @classmethod
    def _from_driver(cls) -> BatchCopier | None:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            driver = ctypes.PyDLL(name)  # (the GIL is kept: see the module docstring)
        except OSError:
            return None
        for symbol, reports_fail_index in (
            ("cuMemcpyBatchAsync_v2", False),
            ("cuMemcpyBatchAsync", True),
        ):
            function = getattr(driver, symbol, None)
            if function is not None:
                function.restype = ctypes.c_int
                function_2d = getattr(driver, "cuMemcpy2DAsync_v2", None)
                if function_2d is not None:
                    function_2d.restype = ctypes.c_int
                    function_2d.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
                return cls(function, reports_fail_index, function_2d)
        return None

    @property
    def has_2d(self) -> bool:
        return self._function_2d is not None

    def copy_2d(
        self,
        dst: int,
        dst_pitch: int,
        src: int,
        src_pitch: int,
        width: int,
        height: int,
        stream_handle: int,
    ) -> None:
        """Enqueue `height` rows of `width` bytes, row r from `src + r * src_pitch` to
        `dst + r * dst_pitch`. Raises CopyEngineError if the driver refuses it."""
        params = _Memcpy2D(
            srcMemoryType=_MEMORYTYPE_UNIFIED,
            srcDevice=src,
            srcPitch=src_pitch,
            dstMemoryType=_MEMORYTYPE_UNIFIED,
            dstDevice=dst,
            dstPitch=dst_pitch,
            WidthInBytes=width,
            Height=height,
        )
        result = self._function_2d(ctypes.byref(params), ctypes.c_void_p(stream_handle))
        if result != 0:
            raise CopyEngineError(f"cuMemcpy2DAsync failed with CUresult {result}")

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream_handle: int):
        """Enqueue `dsts[i] <- srcs[i]` (`sizes[i]` bytes each) on the stream.

        The arrays are uint64 and the caller keeps them alive until the copies are done.
        Raises CopyEngineError if the driver refuses the batch (nothing is enqueued then).
        """
        count = len(dsts)
        if not count:
            return
        args = [
            dsts.ctypes.data_as(ctypes.c_void_p),
            srcs.ctypes.data_as(ctypes.c_void_p),
            sizes.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_size_t(count),
            ctypes.byref(self._attrs),
            self._attr_index,
            ctypes.c_size_t(1),
        ]
        fail_index = ctypes.c_size_t(0)
        if self._reports_fail_index:
            args.append(ctypes.byref(fail_index))
        args.append(ctypes.c_void_p(stream_handle))
        result = self._function(*args)
        if result != 0:
            where = f" at copy {fail_index.value}" if self._reports_fail_index else ""
            raise CopyEngineError(f"cuMemcpyBatchAsync failed with CUresult {result}{where}")


def layer_chunk_pointers(
    device_kv_ptr: int,
    device_layer_stride: int,
    host_kv_ptr: int,
    host_page_stride: int,
    chunk_bytes: int,
    layer: int,
    device_page_ids: np.ndarray,
    host_page_ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Addresses of layer `layer`'s chunk of each page: (device, host), uint64 arrays.

    Device pool: (L, P, S, *tok), so a chunk is at base + layer*layer_stride + id*chunk.
    Host pool: (P, L, S, *tok), so a chunk is at base + id*page_stride + layer*chunk.
    """
    device = device_kv_ptr + layer * device_layer_stride + device_page_ids * chunk_bytes
    host = host_kv_ptr + host_page_ids * host_page_stride + layer * chunk_bytes
    return device.astype(np.uint64), host.astype(np.uint64)


def page_runs(
    first_ids: np.ndarray, second_ids: np.ndarray, min_length: int = 2
) -> tuple[list[tuple[int, int, int]], np.ndarray]:
    """Split the pairs (first_ids[i], second_ids[i]) into runs where both ids go up by one.

    Returns the runs of at least `min_length` pairs as (first id, second id, length), and
    the positions of the pairs left over (in shorter runs), in order.
    """
    count = len(first_ids)
    if not count:
        return [], np.zeros(0, dtype=np.int64)
    first = np.asarray(first_ids, dtype=np.int64)
    second = np.asarray(second_ids, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(first) != 1) | (np.diff(second) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [count]])
    runs, rest = [], []
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        if end - start >= min_length:
            runs.append((int(first[start]), int(second[start]), end - start))
        else:
            rest.extend(range(start, end))
    return runs, np.asarray(rest, dtype=np.int64)
