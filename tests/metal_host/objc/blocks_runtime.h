// Stand-in for libobjc2's <objc/blocks_runtime.h>, which GNUstep's headers include when the
// compiler has blocks; Debian's GNU runtime (gcc's libobjc) does not ship it. Declarations only:
// the Metal host check (scripts/check_metal_host.sh) compiles nothing that runs.
#pragma once
#ifdef __cplusplus
extern "C" {
#endif
void* _Block_copy(const void*);
void _Block_release(const void*);
#ifdef __cplusplus
}
#endif
#define Block_copy(x) ((__typeof(x))_Block_copy((const void*)(x)))
#define Block_release(x) _Block_release((const void*)(x))
