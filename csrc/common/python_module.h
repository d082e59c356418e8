// HW_PYTHON_MODULE(name): an empty Python extension module `name`, so that importing
// headwise.<name> loads the op library (and runs its TORCH_LIBRARY registrations).
// Compiled only into the Python build (setup.py defines HEADWISE_PYTHON_MODULE); the
// CMake build for libtorch users has no Python dependency.
#pragma once

#if defined(HEADWISE_PYTHON_MODULE)
#include <Python.h>
#define HW_PYTHON_MODULE(name)                                                           \
  extern "C" PyObject* PyInit_##name(void) {                                             \
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, #name, nullptr, -1, nullptr, \
                                        nullptr, nullptr, nullptr, nullptr};             \
    return PyModule_Create(&module);                                                     \
  }
#else
#define HW_PYTHON_MODULE(name)
#endif
