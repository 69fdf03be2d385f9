// structkv::paged_decode_attention_pools: the fused CPU decode attention (cpu_attention.c) as a
// PyTorch operator. Eager Python calls it as one builtin; a compiled graph (inductor's C++ wrapper)
// calls it through the dispatcher with no Python at all. Checks shapes, dtypes and layouts, then
// hands raw pointers to the C kernel. See kernels/cpu_attention.py for the contract.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

extern "C" {
typedef struct {
    const void *k, *v;
    const float *k_scale, *v_scale;
    const int32_t *table;
    const int32_t *lens;
    int64_t width;
    int32_t bits;
    int32_t block_size;
} pool_t;

int structkv_paged_decode_attention_pools(const float *q, int32_t batch, int32_t hq, int32_t hkv, int32_t d,
                                          const pool_t *pools, int32_t num_pools, float sm_scale, int32_t splits,
                                          int32_t min_split, int32_t num_threads, float *out);
}

namespace {

c10::ScalarType data_dtype(int64_t bits) {
    return bits == 0 ? at::kFloat : bits == 8 ? at::kChar : at::kByte;
}

using OptionalTensors = c10::List<std::optional<at::Tensor>>;

at::Tensor paged_decode_attention_pools(const at::Tensor& q, at::TensorList k, at::TensorList v,
                                        const OptionalTensors& k_scale, const OptionalTensors& v_scale,
                                        at::TensorList block_tables, at::TensorList lens,
                                        at::IntArrayRef bits, const std::optional<at::Tensor>& extra_k,
                                        const std::optional<at::Tensor>& extra_v,
                                        const std::optional<at::Tensor>& extra_mask, double sm_scale,
                                        int64_t min_split) {
    TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
                "q must be a contiguous CPU float32 [B, Hq, D] tensor, got ", q.sizes(), " ", q.scalar_type());
    const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
    const size_t n = k.size();
    TORCH_CHECK(v.size() == n && k_scale.size() == n && v_scale.size() == n && block_tables.size() == n &&
                lens.size() == n && bits.size() == n, "every per-pool list must have ", n, " entries");
    std::vector<pool_t> pools(n, pool_t{});
    int64_t hkv = -1;
    for (size_t i = 0; i < n; i++) {
        const int64_t bi = bits[i];
        TORCH_CHECK(bi == 0 || bi == 8 || bi == 4, "pool ", i, ": bits must be 0, 8 or 4, got ", bi);
        const int64_t dk = bi == 4 ? d / 2 : d;
        TORCH_CHECK(k[i].dim() == 4 && k[i].sizes() == v[i].sizes() && k[i].size(3) == dk &&
                    k[i].scalar_type() == data_dtype(bi) && v[i].scalar_type() == data_dtype(bi) &&
                    k[i].is_contiguous() && v[i].is_contiguous() && k[i].device().is_cpu(),
                    "pool ", i, ": k, v must be contiguous CPU [pages, block_size, Hkv, ", dk, "] of ",
                    data_dtype(bi), ", got ", k[i].sizes(), " ", k[i].scalar_type(), " / ", v[i].sizes());
        TORCH_CHECK(hkv < 0 || hkv == k[i].size(2), "pool ", i, ": KV heads differ between pools");
        hkv = k[i].size(2);
        const at::Tensor& t = block_tables[i];
        const at::Tensor& l = lens[i];
        TORCH_CHECK(t.dim() == 2 && t.size(0) == b && t.scalar_type() == at::kInt && t.is_contiguous(),
                    "pool ", i, ": block table must be contiguous int32 [B=", b, ", W], got ", t.sizes(), " ",
                    t.scalar_type());
        TORCH_CHECK(l.dim() == 1 && l.size(0) == b && l.scalar_type() == at::kInt && l.is_contiguous(),
                    "pool ", i, ": lens must be contiguous int32 [B=", b, "], got ", l.sizes(), " ", l.scalar_type());
        const float *ks = nullptr, *vs = nullptr;
        if (bi) {
            const std::optional<at::Tensor> kso = k_scale.get(i), vso = v_scale.get(i);
            auto want = k[i].sizes().slice(0, 3);
            TORCH_CHECK(kso.has_value() && vso.has_value() && kso->sizes() == want && vso->sizes() == want &&
                        kso->scalar_type() == at::kFloat && vso->scalar_type() == at::kFloat &&
                        kso->is_contiguous() && vso->is_contiguous(),
                        "pool ", i, ": scales must be contiguous float32 ", want);
            ks = kso->data_ptr<float>();
            vs = vso->data_ptr<float>();
        }
        pools[i] = pool_t{k[i].data_ptr(), v[i].data_ptr(), ks, vs, t.data_ptr<int32_t>(), l.data_ptr<int32_t>(),
                          t.size(1), static_cast<int32_t>(bi), static_cast<int32_t>(k[i].size(1))};
    }
    const bool extra = extra_k.has_value();
    TORCH_CHECK(extra == extra_v.has_value() && extra == extra_mask.has_value(),
                "extra_k, extra_v and extra_mask come together");
    if (extra) {
        const at::Tensor &ek = *extra_k, &ev = *extra_v, &em = *extra_mask;
        TORCH_CHECK(ek.dim() == 3 && ek.size(0) == b && ek.size(2) == d && ek.sizes() == ev.sizes() &&
                    (hkv < 0 || ek.size(1) == hkv) && ek.scalar_type() == at::kFloat &&
                    ev.scalar_type() == at::kFloat && ek.is_contiguous() && ev.is_contiguous(),
                    "extra_k, extra_v must be contiguous float32 [B, Hkv, D], got ", ek.sizes(), " ", ek.scalar_type());
        TORCH_CHECK(em.dim() == 1 && em.size(0) == b && em.scalar_type() == at::kBool && em.is_contiguous(),
                    "extra_mask must be contiguous bool [B], got ", em.sizes(), " ", em.scalar_type());
        hkv = ek.size(1);
    }
    // The step's own token: one more HIGH pool whose page b is row b's token (attended last, as the
    // reference does), kept only where extra_mask is set. The kernel needs no special case for it.
    at::Tensor extra_table, extra_lens;
    if (extra && b > 0) {
        extra_table = at::arange(b, q.options().dtype(at::kInt)).view({b, 1});
        extra_lens = extra_mask->to(at::kInt);
        pools.push_back(pool_t{extra_k->data_ptr(), extra_v->data_ptr(), nullptr, nullptr,
                               extra_table.data_ptr<int32_t>(), extra_lens.data_ptr<int32_t>(), 1, 0, 1});
    }
    if (hkv < 0 || b == 0) return at::zeros({b, hq, d}, q.options());
    TORCH_CHECK(hq % hkv == 0, "query heads (", hq, ") must be a multiple of KV heads (", hkv, ")");
    at::Tensor out = at::empty({b, hq, d}, q.options());
    // Rows are cut into ranges of at least min_split entries (flash-decoding's split) when the batch
    // has fewer rows than twice the threads.
    const int64_t threads = at::get_num_threads();
    const int64_t splits = std::max<int64_t>(1, (2 * threads + b - 1) / b);
    const int rc = structkv_paged_decode_attention_pools(
        q.data_ptr<float>(), b, hq, hkv, d, pools.data(), static_cast<int32_t>(pools.size()),
        static_cast<float>(sm_scale), static_cast<int32_t>(splits), static_cast<int32_t>(min_split),
        static_cast<int32_t>(threads), out.data_ptr<float>());
    TORCH_CHECK(rc == 0, "fused CPU decode attention failed (code ", rc, ": 1 bad shape, 2 out of memory)");
    return out;
}

}  // namespace

TORCH_LIBRARY(structkv, m) {
    m.def("paged_decode_attention_pools(Tensor q, Tensor[] k, Tensor[] v, Tensor?[] k_scale, Tensor?[] v_scale, "
          "Tensor[] block_tables, Tensor[] lens, int[] bits, Tensor? extra_k, Tensor? extra_v, "
          "Tensor? extra_mask, float sm_scale, int min_split=256) -> Tensor");
}

TORCH_LIBRARY_IMPL(structkv, CPU, m) {
    m.impl("paged_decode_attention_pools", &paged_decode_attention_pools);
}
