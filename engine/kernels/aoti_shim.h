/* What a kernel's C shim calls of torch's own C shim (torch/csrc/inductor/aoti_torch/c/shim.h,
 * declared here rather than included: the kernels build without torch's headers). An AOTInductor
 * package compiled with an operator in inductor's `custom_ops_to_c_shims` calls the kernel's shim
 * by name, as it calls torch's own, with no Python between. */
#ifndef TRIO_LLM_AOTI_SHIM_H
#define TRIO_LLM_AOTI_SHIM_H

#include <stdint.h>

typedef void *AtenTensorHandle;
typedef int32_t AOTITorchError;
extern AOTITorchError aoti_torch_get_data_ptr(AtenTensorHandle tensor, void **ret);
extern AOTITorchError aoti_torch_get_sizes(AtenTensorHandle tensor, int64_t **ret);
extern AOTITorchError aoti_torch_empty_strided(int64_t ndim, const int64_t *sizes, const int64_t *strides,
                                               int32_t dtype, int32_t device_type, int32_t device_index,
                                               AtenTensorHandle *ret);
extern int32_t aoti_torch_dtype_float32(void);
extern int32_t aoti_torch_device_type_cpu(void);
extern AOTITorchError aoti_torch_get_strides(AtenTensorHandle tensor, int64_t **ret);
extern AOTITorchError aoti_torch_get_dim(AtenTensorHandle tensor, int64_t *ret);
extern AOTITorchError aoti_torch_get_dtype(AtenTensorHandle tensor, int32_t *ret);
extern int32_t aoti_torch_dtype_float16(void);
extern int32_t aoti_torch_dtype_bfloat16(void);
extern int32_t aoti_torch_dtype_int64(void);

#endif
