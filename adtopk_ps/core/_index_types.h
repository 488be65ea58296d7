/* The index types a payload may carry (adtopk_ps/core/dtypes.py's INDEX_DTYPES), by their size
 * in bytes; int32 and int64 are signed. A loop written once per type in BODY (index_t) does not
 * look at the type per entry. Variadic, so that the body's own commas are not the macro's.
 * Shared by the compiled kernels that read positions (core/_sparse_write.c, server/_sparse_sum.c). */
#ifndef ADTOPK_INDEX_TYPES_H
#define ADTOPK_INDEX_TYPES_H

#include <stdint.h>

#define FOR_INDEX_TYPE(size, ...)                               \
    switch (size) {                                             \
    case 1: { typedef uint8_t index_t; __VA_ARGS__; } break;    \
    case 2: { typedef uint16_t index_t; __VA_ARGS__; } break;   \
    case 4: { typedef int32_t index_t; __VA_ARGS__; } break;    \
    default: { typedef int64_t index_t; __VA_ARGS__; } break;   \
    }

#endif
