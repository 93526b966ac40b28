"""What a kernel runs to use the stand-in libcuda as a CUDA program does (``.format`` them:
``lib``, the stand-in's path; ``calls``, its log of calls)."""

#: Device memory allocated and filled with a pattern; ``device_ok()`` reads it back.
USE_GPU = r"""
import ctypes
cuda = ctypes.CDLL({lib!r})
assert cuda.cuInit(0) == 0
device = ctypes.c_int(); context = ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
assert cuda.cuCtxSetCurrent(context) == 0
size = 1 << 20
dptr = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(size)) == 0
pattern = (ctypes.c_ubyte * size)(*[(i * 7) % 251 for i in range(size)])
assert cuda.cuMemcpyHtoD_v2(dptr, pattern, ctypes.c_size_t(size)) == 0

def device_ok():
    back = (ctypes.c_ubyte * size)()
    rc = cuda.cuMemcpyDtoH_v2(back, dptr, ctypes.c_size_t(size))
    return rc == 0 and bytes(back) == bytes(pattern)
print(device_ok())
"""


# A framework's cache, as the kernel's snapshot agent sees it: a releaser (registered the
# way kernel_wrapper.inkernel.agent registers PyTorch's and CuPy's) frees a cached device block.
CACHED_BLOCK = r"""
import kernel_wrapper.inkernel.agent as agent
cached = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(cached), ctypes.c_size_t(3 << 20)) == 0
seen_at_release = []

def release_test_cache():
    seen_at_release.extend(open({calls!r}).read().split())
    if not cached.value:
        return None
    assert cuda.cuMemFree_v2(cached) == 0
    cached.value = 0
    return 3 << 20

def broken_cache():
    raise RuntimeError("this framework cannot release now")

agent.RELEASERS["test-cache"] = release_test_cache
agent.RELEASERS["broken"] = broken_cache
"""
