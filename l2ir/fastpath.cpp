// The compiled eager path of l2ir.matmul: the route table of l2ir/dispatch.py, looked up and run in C++.
//
// An eager l2ir.matmul call on a small GEMM is host-bound: torch.matmul's own call costs ~10 us of host time and the
// kernel ~2-5 us. In Python, building the route key (shapes, strides, dtypes, devices), the closure and the ctypes
// launch cost ~1-3 us per call, so a call that ends in cuBLAS costs more than torch.matmul and a served call pays
// ctypes. Here a call is: two tensor unpacks, a key of integers hashed into an unordered_map, then either the
// fallback op (at::mm or at::matmul, called without torch's Python argument parser) or the output allocation and
// the launch through the driver's or the host shim's C entry point.
//
// The table holds only what l2ir/dispatch.py decided (Dispatcher._prepare adds each route as it keeps it); a call
// it does not cover returns None and the Python path runs, so every decision, warning and error stays in one place.
// It never compiles or loads anything, and is built per Python and torch version (l2ir/fastpath.py).

#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// The route key: both operands' dimensions, sizes and strides, dtypes and devices (the fields of
// l2ir.dispatch.fast_key). A with more than kMaxDims dimensions is left to Python.
constexpr int kMaxDims = 6;
constexpr int kKeyLen = 6 + 2 * kMaxDims + 4;
using Key = std::array<int64_t, kKeyLen>;

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t v : k) {
      h ^= static_cast<uint64_t>(v);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

int64_t device_word(const at::Tensor& t) {
  const c10::Device d = t.device();
  return (static_cast<int64_t>(d.type()) << 16) | static_cast<int64_t>(d.index() + 1);
}

bool make_key(const at::Tensor& a, const at::Tensor& b, Key& key) {
  const int64_t da = a.dim(), db = b.dim();
  if (da > kMaxDims || db != 2) return false;  // B is 2-D on every route the package serves or counts
  // Dense strided tensors only, with no lazy negation or conjugation and real storage: what else shares a dense
  // tensor's sizes and strides (a sparse tensor reports strides of 0, a negative view the same pointer) is left to
  // the Python path.
  for (const at::Tensor* t : {&a, &b})
    if (t->layout() != at::kStrided || t->is_neg() || t->is_conj() || t->_is_zerotensor()) return false;
  key.fill(0);
  key[0] = da;
  key[1] = db;
  key[2] = static_cast<int64_t>(a.scalar_type());
  key[3] = static_cast<int64_t>(b.scalar_type());
  key[4] = device_word(a);
  key[5] = device_word(b);
  const auto sa = a.sizes(), ta = a.strides(), sb = b.sizes(), tb = b.strides();
  for (int64_t i = 0; i < da; ++i) {
    key[6 + i] = sa[i];
    key[6 + kMaxDims + i] = ta[i];
  }
  key[6 + 2 * kMaxDims + 0] = sb[0];
  key[6 + 2 * kMaxDims + 1] = sb[1];
  key[6 + 2 * kMaxDims + 2] = tb[0];
  key[6 + 2 * kMaxDims + 3] = tb[1];
  return true;
}

// The two launch entry points, declared here so that no CUDA header is needed (the CPU build serves the tests).
using LaunchKernelFn = int (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                               unsigned smem, void* stream, void** params, void** extra);
using GetCtxFn = int (*)(void** ctx);

// cuLaunchKernelEx's config, laid out as cuda.h's CUlaunchConfig and CUlaunchAttribute (CUDA 12 and later; the
// test suite compiles cuda.h and compares): a launch that lets the grid start while the stream's previous kernel
// drains (programmatic dependent launch). The kernels wait (griddepcontrol.wait) before their first global access.
struct alignas(8) LaunchAttribute {
  unsigned id;
  char pad[4];
  union {
    int programmatic_stream_serialization;
    char bytes[64];
  } value;
};
struct LaunchConfig {
  unsigned gx, gy, gz, bx, by, bz, smem;
  void* stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};
static_assert(sizeof(LaunchAttribute) == 72 && alignof(LaunchAttribute) == 8 && offsetof(LaunchAttribute, value) == 8,
              "cuda.h's CUlaunchAttribute");
static_assert(sizeof(LaunchConfig) == 56 && offsetof(LaunchConfig, stream) == 32 && offsetof(LaunchConfig, attrs) == 40,
              "cuda.h's CUlaunchConfig");
constexpr unsigned kProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
using LaunchKernelExFn = int (*)(const LaunchConfig* config, void* f, void** params, void** extra);

// l2ir_run_args's block: the field order of l2ir.runtime.RUN_ARGS_FIELDS (a test checks the sizes agree).
struct RunArgs {
  const void* a;
  const void* b;
  void* c;
  int m, n, k;
  void* workspace;
  size_t workspace_bytes;
  void* stream;
};
using RunArgsFn = int (*)(const RunArgs*);

struct Grid {
  void* fn;
  unsigned gx, gy, gz, bx, by, bz, smem;
  unsigned pdl;  // launched through cuLaunchKernelEx with programmatic stream serialization
};

enum Kind { kFallback = 0, kKernel = 1, kShim = 2, kPython = 3 };

// Owned references to Python objects, released with the GIL held (routes die inside calls from Python).
struct PyRef {
  PyObject* p = nullptr;
  PyRef() = default;
  explicit PyRef(PyObject* o) : p(o) { Py_XINCREF(p); }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() { Py_XDECREF(p); }
  void reset(PyObject* o) {
    Py_XINCREF(o);
    Py_XDECREF(p);
    p = o;
  }
};

// A new reference, released at scope exit (GIL held: every use is outside NoGil scopes).
struct PyOwned {
  PyObject* p;
  explicit PyOwned(PyObject* o) : p(o) {}
  PyOwned(const PyOwned&) = delete;
  PyOwned& operator=(const PyOwned&) = delete;
  ~PyOwned() { Py_XDECREF(p); }
};

// After a failed Python call: an ordinary exception is cleared and the caller takes the cautious path (true);
// anything else (KeyboardInterrupt, SystemExit) stays set for the caller to propagate (false).
bool recoverable() {
  if (!PyErr_Occurred()) return true;
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return false;
  PyErr_Clear();
  return true;
}

struct Route {
  int kind = kFallback;
  int reason = 0;             // the counter of a fallback route
  bool matmul = false;        // fallback op: at::matmul (batched A) or at::mm (2-D)
  // A served route:
  bool want_cuda = true;      // the dispatcher's device type (CPU stands in for CUDA in the tests)
  bool eager_only = false;    // cuBLAS inside a CUDA-graph capture (l2ir/export.py's eager kernels)
  int64_t index = 0;          // device index, for the stream
  std::vector<int64_t> shape; // the output's shape
  int m = 0, n = 0, k = 0;
  size_t ws_bytes = 0;
  LaunchKernelFn launch = nullptr;
  LaunchKernelExFn launch_ex = nullptr;  // the PDL grids' entry point (null when no grid asks for PDL)
  GetCtxFn get_ctx = nullptr;  // cuCtxGetCurrent: the launch runs only where the route's context is current
  void* ctx = nullptr;         // the device's primary context (torch's), which holds the module or the shim's kernels
  std::vector<Grid> grids;
  RunArgsFn run_args = nullptr;
  PyRef go;                   // kPython: go(a, b, c, ws, stream), the runner's own launch
  PyRef keep;                 // keep(a, stream) -> (workspace tensor, kept: bool), the dispatcher's budget
  PyRef failed;               // failed(message): the dispatcher forgets this runner (and clears this table)
  std::vector<std::pair<int64_t, at::Tensor>> kept;  // stream -> the route's kept workspace
};

using RouteMap = std::unordered_map<Key, std::shared_ptr<Route>, KeyHash>;

struct Table {
  PyObject_HEAD
  RouteMap* routes;
  std::vector<int64_t>* counts;
  PyObject* stream_of;   // index -> raw stream handle
  PyObject* capturing;   // () -> bool
  int c_l2ir, c_cpu, c_misaligned, c_launch_failed, c_cublas;
};

// Released around the op and the launch, as torch's own bindings do: a cuBLAS call or an allocation never holds
// other Python threads.
struct NoGil {
  PyThreadState* state;
  NoGil() : state(PyEval_SaveThread()) {}
  ~NoGil() { PyEval_RestoreThread(state); }
};

// Whether autograd has nothing to record or propagate for these operands: neither has autograd metadata (no
// requires_grad, no grad_fn, no forward-mode tangent, not a view that tracks its base's version). Then the op may
// dispatch below the autograd keys, as torch's own autograd kernels do for the op they wrap; the result is what
// torch.mm returns for such operands (no graph).
bool plain(const at::Tensor& a, const at::Tensor& b) {
  return a.unsafeGetTensorImpl()->autograd_meta() == nullptr && b.unsafeGetTensorImpl()->autograd_meta() == nullptr;
}

at::Tensor fallback_op(const Route& r, const at::Tensor& a, const at::Tensor& b) {
  if (plain(a, b)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return r.matmul ? at::matmul(a, b) : at::mm(a, b);
  }
  return r.matmul ? at::matmul(a, b) : at::mm(a, b);
}

PyObject* fallback(Table* self, const Route& r, const at::Tensor& a, const at::Tensor& b, int counter) {
  at::Tensor c;
  try {
    NoGil no_gil;
    c = fallback_op(r, a, b);
  } catch (const std::exception&) {
    Py_RETURN_NONE;  // torch's own error, raised again by the Python path's torch call
  }
  (*self->counts)[counter] += 1;
  return THPVariable_Wrap(std::move(c));
}

// fn() as a bool: 1, 0, or -1 with an exception set that must propagate. An ordinary error counts as true (the
// cautious answer: capturing) and is cleared.
int truth(PyObject* fn) {
  PyOwned v(PyObject_CallNoArgs(fn));
  if (v.p == nullptr) return recoverable() ? 1 : -1;
  const int t = PyObject_IsTrue(v.p);
  if (t < 0) return recoverable() ? 1 : -1;
  return t;
}

PyObject* serve(Table* self, const std::shared_ptr<Route>& rp, PyObject* oa, const at::Tensor& a,
                const at::Tensor& b) {
  Route& r = *rp;
  if (a.is_cuda() != r.want_cuda || b.is_cuda() != r.want_cuda) return fallback(self, r, a, b, self->c_cpu);
  // Autocast to another dtype changes the result's dtype, and forward-mode AD adds a tangent: torch.matmul's answer,
  // through Python.
  const at::DeviceType dev = r.want_cuda ? at::kCUDA : at::kCPU;
  if (at::autocast::is_autocast_enabled(dev) && at::autocast::get_autocast_dtype(dev) != a.scalar_type())
    Py_RETURN_NONE;
  if (!plain(a, b) && (a._fw_grad(0).defined() || b._fw_grad(0).defined())) Py_RETURN_NONE;
  const uintptr_t pa = reinterpret_cast<uintptr_t>(a.data_ptr()), pb = reinterpret_cast<uintptr_t>(b.data_ptr());
  // TMA, cp.async and vector loads need 16-byte aligned operands; a view can start anywhere.
  if ((pa | pb) & 15) return fallback(self, r, a, b, self->c_misaligned);
  if (r.get_ctx != nullptr) {
    // The kernels live in the device's primary context, and a host shim launches on the current device: run here
    // only when that context is current (torch's current device is the operands'); otherwise the Python route runs
    // the launch under a device guard, which restores the caller's device.
    void* cur = nullptr;
    if (r.get_ctx(&cur) != 0 || cur != r.ctx) Py_RETURN_NONE;
  }
  if (r.eager_only || r.ws_bytes) {
    const int capt = truth(self->capturing);
    if (capt < 0) return nullptr;
    if (capt && r.eager_only) return fallback(self, r, a, b, self->c_cublas);
    if (capt) Py_RETURN_NONE;  // a captured workspace is the graph's own allocation: the Python route makes it
  }
  PyOwned idx(PyLong_FromLongLong(r.index));
  if (idx.p == nullptr) return recoverable() ? Py_NewRef(Py_None) : nullptr;
  PyOwned st_obj(PyObject_CallOneArg(self->stream_of, idx.p));
  if (st_obj.p == nullptr) return recoverable() ? Py_NewRef(Py_None) : nullptr;
  const int64_t st = static_cast<int64_t>(PyLong_AsUnsignedLongLongMask(st_obj.p));
  if (PyErr_Occurred()) return recoverable() ? Py_NewRef(Py_None) : nullptr;
  void* ws = nullptr;
  at::Tensor ws_hold;  // a workspace the budget did not keep lives until the launch is issued
  if (r.ws_bytes) {
    for (auto& kv : r.kept)
      if (kv.first == st) ws = kv.second.data_ptr();
    if (ws == nullptr) {
      PyOwned got(PyObject_CallFunctionObjArgs(r.keep.p, oa, st_obj.p, nullptr));
      if (got.p == nullptr) return recoverable() ? Py_NewRef(Py_None) : nullptr;
      if (!PyTuple_Check(got.p) || PyTuple_GET_SIZE(got.p) != 2 || !THPVariable_Check(PyTuple_GET_ITEM(got.p, 0)))
        Py_RETURN_NONE;
      ws_hold = THPVariable_Unpack(PyTuple_GET_ITEM(got.p, 0));
      ws = ws_hold.data_ptr();
      // Kept under the dispatcher's budget: reused by this route on this stream. Over the budget: this call's
      // alone, released after the launch to the caching allocator, which orders its reuse after this stream's
      // work.
      const int kept = PyObject_IsTrue(PyTuple_GET_ITEM(got.p, 1));
      if (kept < 0) return recoverable() ? Py_NewRef(Py_None) : nullptr;
      if (kept) r.kept.emplace_back(st, ws_hold);
    }
  }
  at::Tensor c;
  try {
    NoGil no_gil;
    at::AutoDispatchBelowADInplaceOrView below_autograd;   // a fresh output: nothing for autograd to record
    c = at::empty(r.shape, a.options());
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
  void* pc = c.data_ptr();
  int rc = 0;
  std::string why;
  if (r.kind == kKernel) {
    void* va = reinterpret_cast<void*>(pa);
    void* vb = reinterpret_cast<void*>(pb);
    int m = r.m, n = r.n, k = r.k;
    void* params[7] = {&va, &vb, &pc, &m, &n, &k, &ws};  // the L2IR kernel ABI: (A, B, C, M, N, K, workspace)
    NoGil no_gil;
    for (size_t i = 0; rc == 0 && i < r.grids.size(); ++i) {
      const Grid& g = r.grids[i];
      if (g.pdl) {
        LaunchAttribute attr{};
        attr.id = kProgrammaticStreamSerialization;
        attr.value.programmatic_stream_serialization = 1;
        const LaunchConfig config{g.gx, g.gy, g.gz, g.bx, g.by, g.bz, g.smem, reinterpret_cast<void*>(st), &attr, 1};
        rc = r.launch_ex(&config, g.fn, params, nullptr);
      } else {
        rc = r.launch(g.fn, g.gx, g.gy, g.gz, g.bx, g.by, g.bz, g.smem, reinterpret_cast<void*>(st), params, nullptr);
      }
    }
    if (rc) why = "cuLaunchKernel(Ex) returned CUresult " + std::to_string(rc);
  } else if (r.kind == kShim) {
    const RunArgs args{reinterpret_cast<const void*>(pa), reinterpret_cast<const void*>(pb), pc, r.m, r.n, r.k, ws,
                       r.ws_bytes, reinterpret_cast<void*>(st)};
    NoGil no_gil;
    rc = r.run_args(&args);
    if (rc) why = "l2ir_run returned " + std::to_string(rc);
  } else {
    PyOwned res(PyObject_CallFunction(r.go.p, "KKKKO", static_cast<unsigned long long>(pa),
                                      static_cast<unsigned long long>(pb),
                                      static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(pc)),
                                      static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(ws)), st_obj.p));
    if (res.p == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;   // KeyboardInterrupt: not a launch failure
      PyObject *type, *value, *tb;
      PyErr_Fetch(&type, &value, &tb);
      PyOwned owned_type(type), owned_value(value), owned_tb(tb);
      PyOwned text(value ? PyObject_Str(value) : nullptr);
      const char* utf8 = text.p ? PyUnicode_AsUTF8(text.p) : nullptr;
      PyErr_Clear();
      why = utf8 && *utf8 ? utf8 : "the runner's launch raised";
      rc = -1;
    }
  }
  if (rc) {
    // The dispatcher warns once and forgets the runner (its routes decide again: load_failed); this call is
    // answered by torch.
    PyOwned res(PyObject_CallFunction(r.failed.p, "s", why.c_str()));
    if (res.p == nullptr && !recoverable()) return nullptr;
    return fallback(self, r, a, b, self->c_launch_failed);
  }
  (*self->counts)[self->c_l2ir] += 1;
  return THPVariable_Wrap(std::move(c));
}

// table(a, b): the result, or None where the Python path must run (no route kept for these operands, a subclass,
// an input that requires grad, a captured workspace, an error it leaves to torch's own call to raise).
PyObject* lookup_and_run(Table* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) Py_RETURN_NONE;
  PyObject *oa = args[0], *ob = args[1];
  if (!THPVariable_CheckExact(oa) || !THPVariable_CheckExact(ob)) Py_RETURN_NONE;
  const at::Tensor& a = THPVariable_Unpack(oa);
  const at::Tensor& b = THPVariable_Unpack(ob);
  if ((a.requires_grad() || b.requires_grad()) && c10::GradMode::is_enabled()) Py_RETURN_NONE;
  // A TorchFunctionMode sees torch.mm in the Python path; here it would not.
  if (at::impl::torch_function_mode_enabled()) Py_RETURN_NONE;
  Key key;
  if (!make_key(a, b, key)) Py_RETURN_NONE;
  auto it = self->routes->find(key);
  if (it == self->routes->end()) Py_RETURN_NONE;
  std::shared_ptr<Route> r = it->second;  // alive through this call even if a failure clears the table
  if (r->kind == kFallback) return fallback(self, *r, a, b, r->reason);
  return serve(self, r, oa, a, b);
}

PyObject* Table_call(Table* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    return lookup_and_run(self, args, nargs);
  } catch (const std::exception&) {
    // A tensor without strides or storage (a functorch wrapper): the Python path answers, or raises torch's own
    // error. Python references taken on the way are owned (PyOwned) and released by the unwinding.
    Py_RETURN_NONE;
  }
}

bool key_of(PyObject* oa, PyObject* ob, Key& key) {
  if (!THPVariable_Check(oa) || !THPVariable_Check(ob)) {
    PyErr_SetString(PyExc_TypeError, "l2ir fast path: the operands must be tensors");
    return false;
  }
  if (!make_key(THPVariable_Unpack(oa), THPVariable_Unpack(ob), key)) {
    PyErr_SetString(PyExc_ValueError, "l2ir fast path: holds dense strided operands only, B 2-D and A at most 6-D");
    return false;
  }
  return true;
}

bool put(Table* self, const Key& key, std::shared_ptr<Route> r) {
  (*self->routes)[key] = std::move(r);
  return true;
}

// add_fallback(a, b, counter, matmul)
PyObject* add_fallback_impl(Table* self, PyObject* args) {
  PyObject *oa, *ob;
  int counter, mm;
  if (!PyArg_ParseTuple(args, "OOip", &oa, &ob, &counter, &mm)) return nullptr;
  Key key;
  if (!key_of(oa, ob, key)) return nullptr;
  if (counter < 0 || counter >= static_cast<int>(self->counts->size())) {
    PyErr_SetString(PyExc_ValueError, "l2ir fast path: counter index out of range");
    return nullptr;
  }
  auto r = std::make_shared<Route>();
  r->kind = kFallback;
  r->reason = counter;
  r->matmul = mm != 0;
  put(self, key, std::move(r));
  Py_RETURN_NONE;
}

// add_served(a, b, launch, want_cuda, eager_only, matmul, index, shape, m, n, k, ws_bytes, keep, failed)
// launch: ("kernel", launch_addr, get_ctx_addr, ctx, ((fn, gx, gy, gz, bx, by, bz, smem, pdl), ...), launch_ex_addr),
//         ("shim", run_args_addr, get_ctx_addr, ctx) or ("python", go). A zero get_ctx_addr: no context check
//         (the CPU tests' stand-in device).
constexpr const char* kBadLaunch = "l2ir fast path: launch must be ('kernel', ...), ('shim', ...) or ('python', go)";

PyObject* add_served_impl(Table* self, PyObject* args) {
  PyObject *oa, *ob, *launch, *shape, *keep, *failed;
  int want_cuda, eager_only, mm, m, n, k;
  long long index;
  unsigned long long ws_bytes;
  if (!PyArg_ParseTuple(args, "OOOpppLO!iiiKOO", &oa, &ob, &launch, &want_cuda, &eager_only, &mm, &index,
                        &PyTuple_Type, &shape, &m, &n, &k, &ws_bytes, &keep, &failed))
    return nullptr;
  Key key;
  if (!key_of(oa, ob, key)) return nullptr;
  auto r = std::make_shared<Route>();
  r->want_cuda = want_cuda != 0;
  r->eager_only = eager_only != 0;
  r->matmul = mm != 0;
  r->index = index;
  r->m = m;
  r->n = n;
  r->k = k;
  r->ws_bytes = static_cast<size_t>(ws_bytes);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); ++i) {
    r->shape.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i)));
    if (PyErr_Occurred()) return nullptr;
  }
  if (!PyCallable_Check(failed) || (r->ws_bytes && !PyCallable_Check(keep))) {
    PyErr_SetString(PyExc_TypeError, "l2ir fast path: failed (and keep, with a workspace) must be callables");
    return nullptr;
  }
  r->keep.reset(keep);
  r->failed.reset(failed);
  const char* kind = nullptr;
  PyObject *p1 = nullptr, *p2 = nullptr, *p3 = nullptr, *p4 = nullptr, *p5 = nullptr;
  if (!PyTuple_Check(launch) || PyTuple_GET_SIZE(launch) < 2 ||
      !PyArg_ParseTuple(launch, "s|OOOOO", &kind, &p1, &p2, &p3, &p4, &p5)) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, kBadLaunch);
    return nullptr;
  }
  const std::string kd(kind);
  auto addr = [](PyObject* o) { return reinterpret_cast<void*>(PyLong_AsUnsignedLongLongMask(o)); };
  if (kd == "kernel" && p4 != nullptr && PyTuple_Check(p4) && p5 != nullptr) {
    r->kind = kKernel;
    r->launch = reinterpret_cast<LaunchKernelFn>(addr(p1));
    r->get_ctx = reinterpret_cast<GetCtxFn>(addr(p2));
    r->ctx = addr(p3);
    r->launch_ex = reinterpret_cast<LaunchKernelExFn>(addr(p5));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(p4); ++i) {
      PyObject* g = PyTuple_GET_ITEM(p4, i);
      unsigned long long fn;
      Grid grid{};
      if (!PyArg_ParseTuple(g, "KIIIIIIII", &fn, &grid.gx, &grid.gy, &grid.gz, &grid.bx, &grid.by, &grid.bz,
                            &grid.smem, &grid.pdl))
        return nullptr;
      grid.fn = reinterpret_cast<void*>(fn);
      r->grids.push_back(grid);
    }
  } else if (kd == "shim" && p3 != nullptr) {
    r->kind = kShim;
    r->run_args = reinterpret_cast<RunArgsFn>(addr(p1));
    r->get_ctx = reinterpret_cast<GetCtxFn>(addr(p2));
    r->ctx = addr(p3);
  } else if (kd == "python" && p1 != nullptr && PyCallable_Check(p1)) {
    r->kind = kPython;
    r->go.reset(p1);
  } else {
    PyErr_SetString(PyExc_ValueError, kBadLaunch);
    return nullptr;
  }
  if (PyErr_Occurred()) return nullptr;
  bool pdl_grid = false;
  for (const Grid& g : r->grids) pdl_grid = pdl_grid || g.pdl;
  if ((r->kind == kKernel && (!r->launch || (pdl_grid && !r->launch_ex))) || (r->kind == kShim && !r->run_args)) {
    PyErr_SetString(PyExc_ValueError, "l2ir fast path: a null entry point");
    return nullptr;
  }
  put(self, key, std::move(r));
  Py_RETURN_NONE;
}

// A C++ exception (a tensor whose sizes or strides cannot be read) is a ValueError, never a crash.
template <PyObject* (*F)(Table*, PyObject*)>
PyObject* guarded(Table* self, PyObject* args) {
  try {
    return F(self, args);
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_ValueError, "l2ir fast path: %s", e.what());
    return nullptr;
  }
}

PyObject* Table_add_fallback(Table* self, PyObject* args) { return guarded<add_fallback_impl>(self, args); }
PyObject* Table_add_served(Table* self, PyObject* args) { return guarded<add_served_impl>(self, args); }

PyObject* Table_clear(Table* self, PyObject*) {
  RouteMap old;
  old.swap(*self->routes);  // routes (and their Python references) die here, with the GIL held
  Py_RETURN_NONE;
}

PyObject* Table_counts(Table* self, PyObject*) {
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(self->counts->size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < self->counts->size(); ++i)
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), PyLong_FromLongLong((*self->counts)[i]));
  return out;
}

PyObject* Table_len(Table* self, PyObject*) { return PyLong_FromSize_t(self->routes->size()); }

// Table(counter_names, stream_of, capturing): counter_names must include l2ir, cpu, misaligned, launch_failed and
// cublas, the reasons a served route counts itself.
PyObject* Table_new(PyTypeObject* type, PyObject* args, PyObject*) {
  PyObject *names, *stream_of, *capturing;
  if (!PyArg_ParseTuple(args, "O!OO", &PyTuple_Type, &names, &stream_of, &capturing)) return nullptr;
  if (!PyCallable_Check(stream_of) || !PyCallable_Check(capturing)) {
    PyErr_SetString(PyExc_TypeError, "l2ir fast path: stream_of and capturing must be callables");
    return nullptr;
  }
  int found[5] = {-1, -1, -1, -1, -1};
  const char* want[5] = {"l2ir", "cpu", "misaligned", "launch_failed", "cublas"};
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); ++i) {
    const char* s = PyUnicode_AsUTF8(PyTuple_GET_ITEM(names, i));
    if (s == nullptr) return nullptr;
    for (int j = 0; j < 5; ++j)
      if (std::strcmp(s, want[j]) == 0) found[j] = static_cast<int>(i);
  }
  for (int j = 0; j < 5; ++j)
    if (found[j] < 0) {
      PyErr_Format(PyExc_ValueError, "l2ir fast path: counter_names lacks '%s'", want[j]);
      return nullptr;
    }
  Table* self = reinterpret_cast<Table*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->routes = new RouteMap();
  self->counts = new std::vector<int64_t>(static_cast<size_t>(PyTuple_GET_SIZE(names)), 0);
  Py_INCREF(stream_of);
  Py_INCREF(capturing);
  self->stream_of = stream_of;
  self->capturing = capturing;
  self->c_l2ir = found[0];
  self->c_cpu = found[1];
  self->c_misaligned = found[2];
  self->c_launch_failed = found[3];
  self->c_cublas = found[4];
  return reinterpret_cast<PyObject*>(self);
}

// The routes' callbacks close over the dispatcher that holds this table: a cycle the garbage collector must see.
int Table_traverse(Table* self, visitproc visit, void* arg) {
  Py_VISIT(self->stream_of);
  Py_VISIT(self->capturing);
  if (self->routes != nullptr)
    for (const auto& kv : *self->routes) {
      Py_VISIT(kv.second->go.p);
      Py_VISIT(kv.second->keep.p);
      Py_VISIT(kv.second->failed.p);
    }
  return 0;
}

int Table_clear_refs(Table* self) {
  if (self->routes != nullptr) {
    RouteMap old;
    old.swap(*self->routes);
  }
  Py_CLEAR(self->stream_of);
  Py_CLEAR(self->capturing);
  return 0;
}

void Table_dealloc(Table* self) {
  PyObject_GC_UnTrack(self);
  Table_clear_refs(self);
  delete self->routes;
  delete self->counts;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyMethodDef Table_methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Table_call)), METH_FASTCALL,
     "call(a, b): the result, or None where the Python path must run"},
    {"add_fallback", reinterpret_cast<PyCFunction>(Table_add_fallback), METH_VARARGS,
     "add_fallback(a, b, counter, matmul): these operands' calls go to at::mm (at::matmul), counted"},
    {"add_served", reinterpret_cast<PyCFunction>(Table_add_served), METH_VARARGS,
     "add_served(a, b, launch, want_cuda, eager_only, matmul, index, shape, m, n, k, ws_bytes, keep, failed)"},
    {"clear", reinterpret_cast<PyCFunction>(Table_clear), METH_NOARGS, "forget every route"},
    {"counts", reinterpret_cast<PyCFunction>(Table_counts), METH_NOARGS, "calls per counter, in counter_names order"},
    {"size", reinterpret_cast<PyCFunction>(Table_len), METH_NOARGS, "routes kept"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject TableType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "l2ir_fastpath",
                          "The compiled eager path of l2ir.matmul (l2ir/fastpath.cpp).", -1, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_l2ir_fastpath(void) {
  TableType.tp_name = "l2ir_fastpath.Table";
  TableType.tp_basicsize = sizeof(Table);
  TableType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  TableType.tp_traverse = reinterpret_cast<traverseproc>(Table_traverse);
  TableType.tp_clear = reinterpret_cast<inquiry>(Table_clear_refs);
  TableType.tp_free = PyObject_GC_Del;
  TableType.tp_new = Table_new;
  TableType.tp_dealloc = reinterpret_cast<destructor>(Table_dealloc);
  TableType.tp_methods = Table_methods;
  TableType.tp_doc = "Table(counter_names, stream_of, capturing): the route table of l2ir.dispatch, in C++";
  if (PyType_Ready(&TableType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&TableType);
  if (PyModule_AddObject(m, "Table", reinterpret_cast<PyObject*>(&TableType)) < 0) {
    Py_DECREF(&TableType);
    Py_DECREF(m);
    return nullptr;
  }
  PyModule_AddIntConstant(m, "RUN_ARGS_SIZE", static_cast<long>(sizeof(RunArgs)));
  PyModule_AddIntConstant(m, "MAX_DIMS", kMaxDims);
  return m;
}
