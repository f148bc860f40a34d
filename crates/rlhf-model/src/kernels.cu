// Fused, differentiable CUDA kernels for training: the GPU side of src/kernels.rs.
//
// Why: candle's own fused CUDA kernels have no backward pass, and the composite formulation
// launches one kernel (and in backward several) per primitive op: an RMSNorm is ~9 kernels
// forward, a masked softmax ~7 over the [B, H, T, S] scores. Each kernel here does one op's
// forward or backward in one pass over memory, with the same maths as the CPU kernels.
// Built to PTX by build.rs (nvcc) when the `cuda` feature is on and loaded by
// src/kernels_cuda.rs. Every kernel exists for float, double and bf16 (suffixes _f32, _f64,
// _bf16); arithmetic is in float for float and bf16, in double for double, and row sums of
// softmax denominators are accumulated in double (a 152k-entry vocabulary row).
#include <cuda_bf16.h>
#include <stdint.h>

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_acc(float x);
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}
template <typename T> __device__ __forceinline__ T from_acc(double x);
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }
template <> __device__ __forceinline__ float from_acc<float>(double x) { return (float)x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(double x) {
    return __float2bfloat16((float)x);
}

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float sqrt_acc(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_acc(double x) { return sqrt(x); }

// Block-wide reductions for blocks of BLOCK threads (a multiple of 32, at most 1024).
#define BLOCK 256

template <typename A> __device__ A warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
template <typename A> __device__ A warp_max(A v) {
    for (int o = 16; o > 0; o >>= 1) {
        A w = __shfl_xor_sync(0xffffffff, v, o);
        v = w > v ? w : v;
    }
    return v;
}
// Every thread gets the block's sum. `sh` holds 32 values; callable repeatedly.
template <typename A> __device__ A block_sum(A v, A* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    A r = (threadIdx.x < (blockDim.x >> 5)) ? sh[threadIdx.x] : (A)0;
    if (wid == 0) {
        r = warp_sum(r);
        if (lane == 0) sh[0] = r;
    }
    __syncthreads();
    return sh[0];
}
template <typename A> __device__ A block_max(A v, A* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    A r = (threadIdx.x < (blockDim.x >> 5)) ? sh[threadIdx.x] : (A)(-INFINITY);
    if (wid == 0) {
        r = warp_max(r);
        if (lane == 0) sh[0] = r;
    }
    __syncthreads();
    return sh[0];
}

// ---- softmax(x + mask) over rows of s; x is [B, G, T, S], mask [B, T, S]; one block per row.
template <typename T>
__device__ void masked_softmax(const T* x, const T* mask, T* out, uint32_t s, uint32_t per_batch,
                               uint32_t t) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[32];
    size_t r = blockIdx.x;
    size_t mr = (r / per_batch) * t + r % t;
    const T* xr = x + r * s;
    const T* m = mask + mr * s;
    T* o = out + r * s;
    A mx = -INFINITY;
    for (uint32_t j = threadIdx.x; j < s; j += blockDim.x) {
        A v = to_acc(xr[j]) + to_acc(m[j]);
        mx = v > mx ? v : mx;
    }
    mx = block_max(mx, sh);
    A sum = 0;
    for (uint32_t j = threadIdx.x; j < s; j += blockDim.x)
        sum += exp_acc(to_acc(xr[j]) + to_acc(m[j]) - mx);
    sum = block_sum(sum, sh);
    A inv = (A)1 / sum;
    for (uint32_t j = threadIdx.x; j < s; j += blockDim.x)
        o[j] = from_acc<T>(exp_acc(to_acc(xr[j]) + to_acc(m[j]) - mx) * inv);
}

// ---- grad_x = y * (g - sum(g * y)) per row of s; one block per row.
template <typename T> __device__ void softmax_bwd(const T* y, const T* g, T* out, uint32_t s) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[32];
    size_t r = blockIdx.x;
    const T* yr = y + r * s;
    const T* gr = g + r * s;
    T* o = out + r * s;
    A dot = 0;
    for (uint32_t j = threadIdx.x; j < s; j += blockDim.x) dot += to_acc(yr[j]) * to_acc(gr[j]);
    dot = block_sum(dot, sh);
    for (uint32_t j = threadIdx.x; j < s; j += blockDim.x)
        o[j] = from_acc<T>(to_acc(yr[j]) * (to_acc(gr[j]) - dot));
}

// ---- RMSNorm: y = x * inv_rms(x) * w over rows of h; one block per row.
template <typename T>
__device__ typename Acc<T>::type row_inv_rms(const T* xr, uint32_t h, double eps,
                                             typename Acc<T>::type* sh) {
    typedef typename Acc<T>::type A;
    A ss = 0;
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) {
        A v = to_acc(xr[j]);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    return (A)1 / sqrt_acc(ss / (A)h + (A)eps);
}

template <typename T>
__device__ void rms_norm(const T* x, const T* w, T* out, uint32_t h, double eps) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[32];
    size_t r = blockIdx.x;
    const T* xr = x + r * h;
    A inv = row_inv_rms(xr, h, eps, sh);
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x)
        out[r * h + j] = from_acc<T>(to_acc(xr[j]) * inv * to_acc(w[j]));
}

// grad_x = inv * (g*w - xhat * mean(g*w*xhat)), xhat = x * inv; one block per row.
template <typename T>
__device__ void rms_norm_bwd_x(const T* x, const T* w, const T* g, T* out, uint32_t h,
                               double eps) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[32];
    size_t r = blockIdx.x;
    const T* xr = x + r * h;
    const T* gr = g + r * h;
    A inv = row_inv_rms(xr, h, eps, sh);
    A dot = 0;
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x)
        dot += to_acc(gr[j]) * to_acc(w[j]) * to_acc(xr[j]) * inv;
    A mean = block_sum(dot, sh) / (A)h;
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x)
        out[r * h + j] =
            from_acc<T>(inv * (to_acc(gr[j]) * to_acc(w[j]) - to_acc(xr[j]) * inv * mean));
}

// inv_rms of every row (for the weight's gradient); one block per row.
template <typename T>
__device__ void rms_inv(const T* x, typename Acc<T>::type* invs, uint32_t h, double eps) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[32];
    A inv = row_inv_rms(x + (size_t)blockIdx.x * h, h, eps, sh);
    if (threadIdx.x == 0) invs[blockIdx.x] = inv;
}

// Partial sums of g * x * inv over the rows of split blockIdx.y, per column: partial is
// [splits, h] in the accumulator type. A fixed order per split keeps the result repeatable.
template <typename T>
__device__ void rms_norm_bwd_w_partial(const T* x, const T* g, const typename Acc<T>::type* invs,
                                       typename Acc<T>::type* partial, uint32_t rows, uint32_t h,
                                       uint32_t rows_per_split) {
    typedef typename Acc<T>::type A;
    uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= h) return;
    uint32_t r0 = blockIdx.y * rows_per_split;
    uint32_t r1 = min(rows, r0 + rows_per_split);
    A acc = 0;
    for (uint32_t r = r0; r < r1; r++)
        acc += to_acc(g[(size_t)r * h + c]) * to_acc(x[(size_t)r * h + c]) * invs[r];
    partial[(size_t)blockIdx.y * h + c] = acc;
}

template <typename T>
__device__ void sum_partials(const typename Acc<T>::type* partial, T* out, uint32_t splits,
                             uint32_t h) {
    typedef typename Acc<T>::type A;
    uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= h) return;
    A acc = 0;
    for (uint32_t s = 0; s < splits; s++) acc += partial[(size_t)s * h + c];
    out[c] = from_acc<T>(acc);
}

// ---- SwiGLU: silu(a) * u, and its gradients [da; du] (out has 2n entries).
template <typename A> __device__ __forceinline__ A sigmoid_acc(A a) {
    return (A)1 / ((A)1 + exp_acc(-a));
}

template <typename T> __device__ void swiglu(const T* a, const T* u, T* out, size_t n) {
    typedef typename Acc<T>::type A;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        A ai = to_acc(a[i]);
        out[i] = from_acc<T>(ai * sigmoid_acc(ai) * to_acc(u[i]));
    }
}

template <typename T>
__device__ void swiglu_bwd(const T* a, const T* u, const T* g, T* out, size_t n) {
    typedef typename Acc<T>::type A;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        A ai = to_acc(a[i]);
        A s = sigmoid_acc(ai);
        A gi = to_acc(g[i]);
        out[i] = from_acc<T>(gi * to_acc(u[i]) * s * ((A)1 + ai * ((A)1 - s)));
        out[n + i] = from_acc<T>(gi * ai * s);
    }
}

// ---- RoPE, rotate-half convention: x [B, H, T, D], cos/sin [B, T, D/2]; one thread per pair.
template <typename T>
__device__ void rope(const T* x, const T* cos, const T* sin, T* out, uint32_t h, uint32_t t,
                     uint32_t d, size_t pairs, int inverse) {
    typedef typename Acc<T>::type A;
    uint32_t half = d / 2;
    for (size_t p = (size_t)blockIdx.x * blockDim.x + threadIdx.x; p < pairs;
         p += (size_t)gridDim.x * blockDim.x) {
        size_t row = p / half;
        uint32_t i = p % half;
        size_t ti = row % t;
        size_t bi = row / ((size_t)h * t);
        size_t cs = (bi * t + ti) * half + i;
        A c = to_acc(cos[cs]), s = to_acc(sin[cs]);
        A x1 = to_acc(x[row * d + i]), x2 = to_acc(x[row * d + i + half]);
        if (inverse) {
            out[row * d + i] = from_acc<T>(x1 * c + x2 * s);
            out[row * d + i + half] = from_acc<T>(x2 * c - x1 * s);
        } else {
            out[row * d + i] = from_acc<T>(x1 * c - x2 * s);
            out[row * d + i + half] = from_acc<T>(x2 * c + x1 * s);
        }
    }
}

// ---- Embedding backward: out[ids[r], :] = sum of g[j, :] over the rows j with that id, in row
// order (deterministic, no atomics). One block per row r: a row that is not its id's first
// occurrence does nothing; the first one sums its id's rows from r on, a tile of columns at a
// time. Rows of the table no id names keep the zeros they were allocated with.
#define EMB_K 8
template <typename T>
__device__ void embedding_bwd(const uint32_t* ids, const T* g, typename Acc<T>::type* out,
                              uint32_t n, uint32_t h, uint32_t v) {
    typedef typename Acc<T>::type A;
    __shared__ int earlier;
    uint32_t r = blockIdx.x;
    uint32_t id = ids[r];
    if (id >= v) return;
    if (threadIdx.x == 0) earlier = 0;
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < r; j += blockDim.x)
        if (ids[j] == id) earlier = 1;
    __syncthreads();
    if (earlier) return;
    for (uint32_t c0 = 0; c0 < h; c0 += blockDim.x * EMB_K) {
        A acc[EMB_K];
        for (int k = 0; k < EMB_K; ++k) acc[k] = 0;
        for (uint32_t j = r; j < n; ++j) {
            if (ids[j] != id) continue;
            const T* gr = g + (size_t)j * h;
            for (int k = 0; k < EMB_K; ++k) {
                uint32_t c = c0 + k * blockDim.x + threadIdx.x;
                if (c < h) acc[k] += to_acc(gr[c]);
            }
        }
        for (int k = 0; k < EMB_K; ++k) {
            uint32_t c = c0 + k * blockDim.x + threadIdx.x;
            if (c < h) out[(size_t)id * h + c] = acc[k];
        }
    }
}

// ---- log-probs and entropy of softmax(x * scale) over rows of v (the vocabulary).
// log-sum-exp of a row, every thread gets it; the sum of exponentials in double.
template <typename T>
__device__ double row_lse(const T* xr, uint32_t v, double scale, double* shd) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[32];
    A mx = -INFINITY;
    for (uint32_t j = threadIdx.x; j < v; j += blockDim.x) {
        A z = to_acc(xr[j]) * (A)scale;
        mx = z > mx ? z : mx;
    }
    mx = block_max(mx, sh);
    double sum = 0;
    for (uint32_t j = threadIdx.x; j < v; j += blockDim.x)
        sum += (double)exp_acc(to_acc(xr[j]) * (A)scale - mx);
    sum = block_sum(sum, shd);
    return (double)mx + log(sum);
}

// The per-row results (and their incoming gradients) are in the accumulator type: f32 for
// bf16 logits, as the composite path returns them.
template <typename T>
__device__ void log_probs(const T* x, const uint32_t* idx, typename Acc<T>::type* out, uint32_t v,
                          double scale) {
    typedef typename Acc<T>::type A;
    __shared__ double shd[32];
    size_t r = blockIdx.x;
    const T* xr = x + r * v;
    double lse = row_lse(xr, v, scale, shd);
    uint32_t t = idx[r];
    // A target outside the vocabulary is not read: it yields NaN, which the loss reports.
    if (threadIdx.x == 0)
        out[r] = from_acc<A>(t < v ? (double)to_acc(xr[t]) * scale - lse : (double)NAN);
}

template <typename T>
__device__ void log_probs_bwd(const T* x, const uint32_t* idx, const typename Acc<T>::type* g,
                              T* out, uint32_t v, double scale) {
    typedef typename Acc<T>::type A;
    __shared__ double shd[32];
    size_t r = blockIdx.x;
    const T* xr = x + r * v;
    A lse = (A)row_lse(xr, v, scale, shd);
    A gs = to_acc(g[r]) * (A)scale;
    uint32_t t = idx[r];
    for (uint32_t j = threadIdx.x; j < v; j += blockDim.x) {
        A p = exp_acc(to_acc(xr[j]) * (A)scale - lse);
        out[r * v + j] = from_acc<T>((j == t ? gs : (A)0) - gs * p);
    }
}

// (lse, entropy) of a row; every thread gets both.
template <typename T>
__device__ void row_entropy(const T* xr, uint32_t v, double scale, double* shd, double* lse_out,
                            double* ent_out) {
    typedef typename Acc<T>::type A;
    double lse = row_lse(xr, v, scale, shd);
    double pz = 0;
    for (uint32_t j = threadIdx.x; j < v; j += blockDim.x) {
        A z = to_acc(xr[j]) * (A)scale;
        pz += (double)(exp_acc(z - (A)lse) * z);
    }
    pz = block_sum(pz, shd);
    *lse_out = lse;
    *ent_out = lse - pz;
}

template <typename T>
__device__ void entropy(const T* x, typename Acc<T>::type* out, uint32_t v, double scale) {
    typedef typename Acc<T>::type A;
    __shared__ double shd[32];
    size_t r = blockIdx.x;
    double lse, h;
    row_entropy(x + r * v, v, scale, shd, &lse, &h);
    if (threadIdx.x == 0) out[r] = from_acc<A>(h);
}

template <typename T>
__device__ void entropy_bwd(const T* x, const typename Acc<T>::type* g, T* out, uint32_t v,
                            double scale) {
    typedef typename Acc<T>::type A;
    __shared__ double shd[32];
    size_t r = blockIdx.x;
    const T* xr = x + r * v;
    double lse, h;
    row_entropy(xr, v, scale, shd, &lse, &h);
    A gs = to_acc(g[r]) * (A)scale;
    for (uint32_t j = threadIdx.x; j < v; j += blockDim.x) {
        A logp = to_acc(xr[j]) * (A)scale - (A)lse;
        out[r * v + j] = from_acc<T>(-gs * exp_acc(logp) * (logp + (A)h));
    }
}

// ---- AdamW on f32 parameters with f32 moments (the host loop of train/step.rs, in two
// kernels: new moments out of place, then the parameter in place).
extern "C" __global__ void adamw_moments_f32(const float* g, const float* m, const float* v,
                                             float* out, size_t n, float beta1, float beta2,
                                             float omb1, float omb2, float grad_scale) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i] * grad_scale;
        out[i] = beta1 * m[i] + omb1 * gi;
        out[n + i] = beta2 * v[i] + omb2 * gi * gi;
    }
}

extern "C" __global__ void adamw_apply_f32(float* p, const float* mv, size_t n, float lr,
                                           float eps, float decay_factor, float inv_bc1,
                                           float inv_sqrt_bc2) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float denom = sqrtf(mv[n + i]) * inv_sqrt_bc2 + eps;
        p[i] = p[i] * decay_factor - lr * inv_bc1 * mv[i] / denom;
    }
}

#define INSTANTIATE(T, S)                                                                        \
    extern "C" __global__ void masked_softmax_##S(const T* x, const T* mask, T* out, uint32_t s, \
                                                  uint32_t per_batch, uint32_t t) {              \
        masked_softmax<T>(x, mask, out, s, per_batch, t);                                        \
    }                                                                                            \
    extern "C" __global__ void softmax_bwd_##S(const T* y, const T* g, T* out, uint32_t s) {     \
        softmax_bwd<T>(y, g, out, s);                                                            \
    }                                                                                            \
    extern "C" __global__ void rms_norm_##S(const T* x, const T* w, T* out, uint32_t h,          \
                                            double eps) {                                        \
        rms_norm<T>(x, w, out, h, eps);                                                          \
    }                                                                                            \
    extern "C" __global__ void rms_norm_bwd_x_##S(const T* x, const T* w, const T* g, T* out,    \
                                                  uint32_t h, double eps) {                      \
        rms_norm_bwd_x<T>(x, w, g, out, h, eps);                                                 \
    }                                                                                            \
    extern "C" __global__ void rms_inv_##S(const T* x, Acc<T>::type* invs, uint32_t h,           \
                                           double eps) {                                         \
        rms_inv<T>(x, invs, h, eps);                                                             \
    }                                                                                            \
    extern "C" __global__ void rms_norm_bwd_w_partial_##S(                                       \
        const T* x, const T* g, const Acc<T>::type* invs, Acc<T>::type* partial, uint32_t rows,  \
        uint32_t h, uint32_t rows_per_split) {                                                   \
        rms_norm_bwd_w_partial<T>(x, g, invs, partial, rows, h, rows_per_split);                 \
    }                                                                                            \
    extern "C" __global__ void sum_partials_##S(const Acc<T>::type* partial, T* out,             \
                                                uint32_t splits, uint32_t h) {                   \
        sum_partials<T>(partial, out, splits, h);                                                \
    }                                                                                            \
    extern "C" __global__ void swiglu_##S(const T* a, const T* u, T* out, size_t n) {            \
        swiglu<T>(a, u, out, n);                                                                 \
    }                                                                                            \
    extern "C" __global__ void swiglu_bwd_##S(const T* a, const T* u, const T* g, T* out,        \
                                              size_t n) {                                        \
        swiglu_bwd<T>(a, u, g, out, n);                                                          \
    }                                                                                            \
    extern "C" __global__ void rope_##S(const T* x, const T* cos, const T* sin, T* out,          \
                                        uint32_t h, uint32_t t, uint32_t d, size_t pairs,        \
                                        int inverse) {                                           \
        rope<T>(x, cos, sin, out, h, t, d, pairs, inverse);                                      \
    }                                                                                            \
    extern "C" __global__ void log_probs_##S(const T* x, const uint32_t* idx, Acc<T>::type* out, \
                                             uint32_t v, double scale) {                         \
        log_probs<T>(x, idx, out, v, scale);                                                     \
    }                                                                                            \
    extern "C" __global__ void log_probs_bwd_##S(const T* x, const uint32_t* idx,                \
                                                 const Acc<T>::type* g, T* out, uint32_t v,      \
                                                 double scale) {                                 \
        log_probs_bwd<T>(x, idx, g, out, v, scale);                                              \
    }                                                                                            \
    extern "C" __global__ void entropy_##S(const T* x, Acc<T>::type* out, uint32_t v,            \
                                           double scale) {                                       \
        entropy<T>(x, out, v, scale);                                                            \
    }                                                                                            \
    extern "C" __global__ void entropy_bwd_##S(const T* x, const Acc<T>::type* g, T* out,        \
                                               uint32_t v, double scale) {                       \
        entropy_bwd<T>(x, g, out, v, scale);                                                     \
    }                                                                                            \
    extern "C" __global__ void embedding_bwd_##S(const uint32_t* ids, const T* g,                \
                                                 Acc<T>::type* out, uint32_t n, uint32_t h,      \
                                                 uint32_t v) {                                   \
        embedding_bwd<T>(ids, g, out, n, h, v);                                                  \
    }

INSTANTIATE(float, f32)
INSTANTIATE(double, f64)
INSTANTIATE(__nv_bfloat16, bf16)

// ---- Content hash of a byte range, for the checksum of a CUDA IPC weight sync (src/ipc.rs).
// The sum over 16-bit units u_i of mix(u_i, base + i), in 64 bits: order-free (any grid gives
// the same sum) and position-aware (the index enters every term). src/ipc.rs::hash_bytes is
// the same function on the host. `x` points at `n` units; the block sums land in `*out`.
__device__ __forceinline__ uint32_t ipc_mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7feb352dU;
    h ^= h >> 15;
    h *= 0x846ca68bU;
    h ^= h >> 16;
    return h;
}
__device__ __forceinline__ unsigned long long ipc_term(uint32_t u, unsigned long long i) {
    uint32_t lo = (uint32_t)i, hi = (uint32_t)(i >> 32);
    uint32_t a = ipc_mix32(u ^ (lo * 0x9E3779B1U) ^ (hi * 0x85EBCA77U));
    uint32_t b = ipc_mix32(a ^ 0x5bd1e995U ^ (hi + 0x27d4eb2fU));
    return ((unsigned long long)a << 32) | b;
}
extern "C" __global__ void ipc_hash(const uint16_t* x, unsigned long long n,
                                    unsigned long long base, unsigned long long* out) {
    unsigned long long acc = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        acc += ipc_term(x[i], base + i);
    // One atomic per block (launched with few blocks): same-address atomics per warp
    // serialised and cost more than the hashing.
    __shared__ unsigned long long part[32];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffU, acc, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {
        acc = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0;
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffU, acc, o);
        if (threadIdx.x == 0) atomicAdd(out, acc);
    }
}
