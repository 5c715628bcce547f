// The CUDA FFI handler symbols defined outside cuda_module.cc (one file per op), registered by it.
#pragma once
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMsaDecodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMsaPrefillCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMsaPrefillWindowCuda);
