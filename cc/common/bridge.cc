#include "cc/common/bridge.h"

#include <c10/util/Exception.h>
#include <torch/csrc/Exceptions.h>

namespace v4 {
namespace {

void translate(const std::exception_ptr& p, void*) {
  // Most derived first: every c10 error below is a c10::Error.
  try {
    std::rethrow_exception(p);
  } catch (python_error& e) {
    // A Python exception raised inside the op (an autograd hook: torch's checkpoint stops its
    // recomputation early by raising one through the ops it recomputes) goes back as itself.
    e.restore();
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (const c10::OutOfMemoryError& e) {
    // torch.OutOfMemoryError (a RuntimeError), so callers can catch it as torch does.
    nanobind::object oom = nanobind::module_::import_("torch").attr("OutOfMemoryError");
    PyErr_SetString(oom.ptr(), e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  }
  // Anything else propagates to nanobind's own translators (std::exception -> RuntimeError).
}

}  // namespace

void init_module(nanobind::module_&) { nanobind::register_exception_translator(translate); }

}  // namespace v4
