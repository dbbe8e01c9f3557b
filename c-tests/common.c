/* Input generation, reference results and checks shared by the C programs.
 * See common.h for the contract. */
#define _GNU_SOURCE
#include "common.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- hashing */

uint64_t mix64(uint64_t x)
{
    /* splitmix64 finalizer: cheap, good enough to make inputs look random. */
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

uint64_t fnv1a(uint64_t h, const void *p, size_t n)
{
    /* FNV-1a 64 over little-endian 64-bit words (then the tail bytes): the
     * same construction as byte-wise FNV-1a, 8x fewer steps on 16 MiB. */
    const unsigned char *b = p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h ^= w;
        h *= 0x100000001b3ULL;
    }
    for (; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

static uint64_t rank_seed(uint64_t seed, int world_rank)
{
    return mix64(seed * 0x9e3779b97f4a7c15ULL ^ (uint64_t)(world_rank + 1) * 0xc2b2ae3d27d4eb4fULL);
}

static inline uint64_t elem_hash(uint64_t rs, size_t i)
{
    return mix64(rs ^ ((uint64_t)i * 0xd1b54a32d192ed03ULL));
}

/* ------------------------------------------------------------ types, ops */

static const struct elem_type *types_table(void)
{
    static struct elem_type t[EK_COUNT];
    static bool init;
    if (!init) {
        /* MPI handles are not compile-time constants under Open MPI. */
        t[EK_FLOAT] = (struct elem_type){EK_FLOAT, "FLOAT", MPI_FLOAT, 4, true, true};
        t[EK_DOUBLE] = (struct elem_type){EK_DOUBLE, "DOUBLE", MPI_DOUBLE, 8, true, true};
        t[EK_INT] = (struct elem_type){EK_INT, "INT", MPI_INT, 4, false, true};
        t[EK_UNSIGNED] = (struct elem_type){EK_UNSIGNED, "UNSIGNED", MPI_UNSIGNED, 4, false, false};
        t[EK_LONG] = (struct elem_type){EK_LONG, "LONG", MPI_LONG, sizeof(long), false, true};
        t[EK_INT64] = (struct elem_type){EK_INT64, "INT64_T", MPI_INT64_T, 8, false, true};
        t[EK_UINT64] = (struct elem_type){EK_UINT64, "UINT64_T", MPI_UINT64_T, 8, false, false};
        t[EK_SHORT] = (struct elem_type){EK_SHORT, "SHORT", MPI_SHORT, sizeof(short), false, true};
        init = true;
    }
    return t;
}

const struct elem_type *elem_type(enum elem_kind k)
{
    return &types_table()[k];
}

const char *op_name(enum op_kind op)
{
    static const char *names[OPK_COUNT] = {"SUM", "MAX", "MIN", "PROD", "BAND", "BOR", "BXOR", "USER"};
    return names[op];
}

bool op_applies(enum op_kind op, const struct elem_type *t)
{
    if (op == OPK_BAND || op == OPK_BOR || op == OPK_BXOR)
        return !t->is_float;
    return true;
}

const char *pattern_name(enum pattern p)
{
    static const char *names[] = {"int", "real", "dyadic", "subnormal", "special", "pow2"};
    return names[p];
}

enum pattern default_pattern(enum op_kind op, const struct elem_type *t)
{
    if (!t->is_float)
        return PAT_INT;
    return op == OPK_PROD ? PAT_POW2 : PAT_REAL;
}

/* Modulus of the integer user op: prime, and sums of two residues fit in the
 * type (short is promoted to int in C arithmetic). */
static uint64_t user_modulus(const struct elem_type *t)
{
    return t->size == 2 ? 32749 : 65521;
}

static double maxabs(double a, double b)
{
    /* Ties of equal magnitude broken by value so the op is commutative. */
    if (fabs(a) != fabs(b))
        return fabs(a) > fabs(b) ? a : b;
    return a > b ? a : b;
}

#define USER_MODADD(CT, M)                                     \
    do {                                                       \
        const CT *a = in;                                      \
        CT *b = inout;                                         \
        for (int i = 0; i < *len; i++)                         \
            b[i] = (CT)(((uint64_t)a[i] + (uint64_t)b[i]) % (M)); \
    } while (0)

static void user_fn(void *in, void *inout, int *len, MPI_Datatype *dt)
{
    MPI_Datatype d = *dt;
    if (d == MPI_FLOAT) {
        const float *a = in;
        float *b = inout;
        for (int i = 0; i < *len; i++)
            b[i] = (float)maxabs(a[i], b[i]);
    } else if (d == MPI_DOUBLE) {
        const double *a = in;
        double *b = inout;
        for (int i = 0; i < *len; i++)
            b[i] = maxabs(a[i], b[i]);
    } else if (d == MPI_INT) {
        USER_MODADD(int, 65521);
    } else if (d == MPI_UNSIGNED) {
        USER_MODADD(unsigned, 65521);
    } else if (d == MPI_LONG) {
        USER_MODADD(long, 65521);
    } else if (d == MPI_INT64_T) {
        USER_MODADD(int64_t, 65521);
    } else if (d == MPI_UINT64_T) {
        USER_MODADD(uint64_t, 65521);
    } else if (d == MPI_SHORT) {
        USER_MODADD(short, 32749);
    } else {
        fprintf(stderr, "user_fn: unexpected datatype\n");
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
}

static MPI_Op user_op = MPI_OP_NULL;

MPI_Op op_handle(enum op_kind op)
{
    switch (op) {
    case OPK_SUM: return MPI_SUM;
    case OPK_MAX: return MPI_MAX;
    case OPK_MIN: return MPI_MIN;
    case OPK_PROD: return MPI_PROD;
    case OPK_BAND: return MPI_BAND;
    case OPK_BOR: return MPI_BOR;
    case OPK_BXOR: return MPI_BXOR;
    case OPK_USER:
        if (user_op == MPI_OP_NULL)
            MPI_Op_create(user_fn, 1, &user_op);
        return user_op;
    default: break;
    }
    abort();
}

void ops_free(void)
{
    if (user_op != MPI_OP_NULL)
        MPI_Op_free(&user_op);
}

static uint64_t width_mask(const struct elem_type *t);

bool mpi_op_broken(const struct elem_type *t, enum op_kind op)
{
    /* MPICH 4.0.2 (Debian 12) reduces unsigned integers as signed for MAX
     * and MIN (pmodels/mpich#6083, fixed in 4.1). MPI_Reduce_local is not
     * intercepted by liberar, so this probes the MPI library itself. */
    if (t->is_float || t->is_signed || (op != OPK_MAX && op != OPK_MIN))
        return false;
    uint64_t big = width_mask(t), small = 5, in = 0, inout = 0;
    memcpy(&in, &big, t->size);
    memcpy(&inout, &small, t->size);
    MPI_Reduce_local(&in, &inout, 1, t->dt, op_handle(op));
    uint64_t want = op == OPK_MAX ? big : small;
    return memcmp(&inout, &want, t->size) != 0;
}

/* ------------------------------------------------------------ inputs */

/* What one contributor needs to produce its input elements. */
struct member {
    int world_rank;
    int pos;       /* local rank in the contributing group */
    int npos;      /* size of the contributing group */
    uint64_t rs;   /* per-rank stream */
    uint64_t rs_pair; /* shared by world ranks 2k and 2k+1: cancelling pairs */
};

static struct member member_make(const struct rcase *c, int world_rank, int pos, int npos)
{
    struct member m = {world_rank, pos, npos, rank_seed(c->seed, world_rank),
                       rank_seed(c->seed ^ 0x5555, world_rank >> 1)};
    return m;
}

static uint64_t width_mask(const struct elem_type *t)
{
    return t->size >= 8 ? ~0ULL : (1ULL << (8 * t->size)) - 1;
}

static int64_t sign_extend(uint64_t v, const struct elem_type *t)
{
    unsigned sh = 64 - 8 * (unsigned)t->size;
    return (int64_t)(v << sh) >> sh;
}

/* Bit pattern (zero-extended) of one integer input element. */
static uint64_t int_value(const struct rcase *c, const struct member *m, size_t i)
{
    const struct elem_type *t = c->t;
    uint64_t mask = width_mask(t), h = elem_hash(m->rs, i);
    unsigned w = 8 * (unsigned)t->size;
    uint64_t h2 = 0, h3 = 0;
    if (c->op == OPK_BAND || c->op == OPK_BOR) {
        h2 = mix64(h);
        h3 = (h2 >> 32) | (h2 << 32);
    }
    switch (c->op) {
    case OPK_SUM:
        if (t->is_signed) {
            /* Bounded so no sum of up to 32 ranks overflows (signed overflow
             * is undefined in C, so MPI owes nothing there); unsigned data
             * uses the full range and wraps. */
            int64_t lim = (int64_t)1 << (w - 7);
            return (uint64_t)((int64_t)(h & (uint64_t)(2 * lim - 1)) - lim) & mask;
        }
        return h & mask;
    case OPK_MAX:
    case OPK_MIN:
        /* Full range, plus the type's extremes and 0 / -1 at some indices:
         * exercises any order-preserving mapping at its ends. */
        if (i % 97 == 0) {
            if (m->pos == 0)
                return t->is_signed ? (mask >> 1) : mask;
            if (m->pos == m->npos - 1)
                return t->is_signed ? ((mask >> 1) + 1) : 0;
        }
        if (i % 89 == 1)
            return (m->pos & 1) ? mask : 0;
        return h & mask;
    case OPK_PROD:
        if (t->is_signed) {
            static const int64_t small[4] = {-2, -1, 1, 2};
            return (uint64_t)small[h & 3] & mask;
        }
        return (h | 1) & mask; /* odd: the wrapped product stays informative */
    case OPK_BAND: return (h | h2 | h3) & mask; /* mostly ones */
    case OPK_BOR: return (h & h2 & h3) & mask;  /* mostly zeros */
    case OPK_BXOR: return h & mask;
    case OPK_USER: return h % user_modulus(t);
    default: break;
    }
    abort();
}

/* 2^e for e in the normal double range, without ldexp's cost. */
static inline double pow2(int e)
{
    uint64_t bits = (uint64_t)(1023 + e) << 52;
    double d;
    memcpy(&d, &bits, 8);
    return d;
}

/* Per-block exponent shared by all ranks; cached since consecutive elements
 * share a block. */
static int block_exponent(const struct rcase *c, size_t blk, bool isf)
{
    static uint64_t last_seed = 0;
    static size_t last_blk = (size_t)-1;
    static int last_e, last_isf = -1;
    if (blk != last_blk || c->seed != last_seed || (int)isf != last_isf) {
        uint64_t bh = mix64(c->seed * 0x2545f4914f6cdd1dULL + blk);
        last_e = isf ? (int)(bh % 61) - 30 : (int)(bh % 201) - 100;
        last_blk = blk;
        last_seed = c->seed;
        last_isf = isf;
    }
    return last_e;
}

/* One float input element as a double (exactly representable in the type). */
static double float_value(const struct rcase *c, const struct member *m, size_t i)
{
    bool isf = c->t->kind == EK_FLOAT;
    uint64_t h = elem_hash(m->rs, i);
    size_t blk = i / 1000;

    switch (c->pat) {
    case PAT_REAL: {
        if (c->op == OPK_MAX || c->op == OPK_MIN) {
            if (i % 101 == 5 && m->pos == 0)
                return INFINITY;
            if (i % 101 == 6 && m->pos == m->npos - 1)
                return -INFINITY;
            if (i % 101 == 7 && m->pos == 0)
                return isf ? FLT_MAX : DBL_MAX;
        }
        double sign = (h & 2) ? -1.0 : 1.0;
        if (i % 5 == 2) {
            /* Ranks 2k and 2k+1 hold x and -x: heavy cancellation. */
            h = elem_hash(m->rs_pair, i);
            sign = (m->world_rank & 1) ? -1.0 : 1.0;
        }
        /* Most blocks span a narrow range around a block exponent (like
         * gradients of one layer); every 11th block spans a huge range. */
        bool wide = blk % 11 == 7;
        int e = wide ? (isf ? (int)(h % 161) - 80 : (int)(h % 1201) - 600)
                     : block_exponent(c, blk, isf) + (int)((h >> 3) % 13) - 6;
        double mant = isf ? (double)((h >> 40) | 1) * 0x1p-24 : (double)((h >> 11) | 1) * 0x1p-53;
        return sign * mant * pow2(e);
    }
    case PAT_DYADIC:
    case PAT_SPECIAL: {
        if (c->pat == PAT_SPECIAL) {
            switch (i % 211) {
            case 3: if (m->pos == 0) return INFINITY; break;
            case 50:
                if (m->pos == m->npos - 1) return -INFINITY;
                if (m->pos == 0) return INFINITY;
                break;
            case 100: if (m->pos == m->npos - 1) return NAN; break;
            case 150: return -0.0;
            case 180: return m->pos == 0 ? 0.0 : -0.0;
            default: break;
            }
        }
        int64_t k = isf ? (int64_t)(h % (1u << 14)) - (1 << 13)
                        : (int64_t)(h % (1ULL << 41)) - (1LL << 40);
        return (double)k * pow2(block_exponent(c, blk, isf));
    }
    case PAT_SUBNORMAL: {
        int64_t k = (int64_t)(h % (1u << 20)) - (1 << 19);
        return ldexp((double)k, isf ? -149 : -1074);
    }
    case PAT_POW2: {
        double v = pow2((int)((h >> 1) % 7) - 3);
        return (h & 1) ? -v : v;
    }
    default: break;
    }
    abort();
}

static void store_elem(const struct elem_type *t, void *buf, size_t i, uint64_t ibits, double fv)
{
    char *p = (char *)buf + i * t->size;
    if (t->kind == EK_FLOAT) {
        float f = (float)fv;
        memcpy(p, &f, 4);
    } else if (t->kind == EK_DOUBLE) {
        memcpy(p, &fv, 8);
    } else {
        /* Little-endian: the low bytes of the bit pattern are the value. */
        memcpy(p, &ibits, t->size);
    }
}

static void fill_input(const struct rcase *c, const struct member *m, void *buf)
{
    for (size_t i = 0; i < c->count; i++) {
        if (c->t->is_float)
            store_elem(c->t, buf, i, 0, float_value(c, m, i));
        else
            store_elem(c->t, buf, i, int_value(c, m, i), 0.0);
    }
}

/* ------------------------------------------------------------ references */

static uint64_t int_combine(const struct rcase *c, uint64_t a, uint64_t b)
{
    const struct elem_type *t = c->t;
    uint64_t mask = width_mask(t);
    switch (c->op) {
    case OPK_SUM: return (a + b) & mask;
    case OPK_PROD: return (a * b) & mask;
    case OPK_MAX:
        if (t->is_signed)
            return sign_extend(a, t) >= sign_extend(b, t) ? a : b;
        return a >= b ? a : b;
    case OPK_MIN:
        if (t->is_signed)
            return sign_extend(a, t) <= sign_extend(b, t) ? a : b;
        return a <= b ? a : b;
    case OPK_BAND: return a & b;
    case OPK_BOR: return a | b;
    case OPK_BXOR: return a ^ b;
    case OPK_USER: return (a + b) % user_modulus(t);
    default: break;
    }
    abort();
}

static double float_combine(enum op_kind op, double a, double b)
{
    switch (op) {
    case OPK_SUM: return a + b;
    case OPK_PROD: return a * b;
    case OPK_MAX: return a >= b ? a : b;
    case OPK_MIN: return a <= b ? a : b;
    case OPK_USER: return maxabs(a, b);
    default: break;
    }
    abort();
}

/* Float sums of PAT_REAL data depend on summation order: checked against
 * the bound every ordered summation meets, not against one answer. */
static bool needs_bound(const struct rcase *c)
{
    return c->t->is_float && c->op == OPK_SUM && c->pat == PAT_REAL;
}

static bool is_deterministic(const struct rcase *c)
{
    return !needs_bound(c);
}

/* Error-free transformation: a + b == s + e exactly. */
static inline void two_sum(double a, double b, double *s, double *e)
{
    double x = a + b, z = x - a;
    *e = (a - (x - z)) + (b - z);
    *s = x;
}

static double load_float(const struct elem_type *t, const void *buf, size_t i)
{
    if (t->kind == EK_FLOAT) {
        float f;
        memcpy(&f, (const char *)buf + 4 * i, 4);
        return f;
    }
    double d;
    memcpy(&d, (const char *)buf + 8 * i, 8);
    return d;
}

static uint64_t load_int(const struct elem_type *t, const void *buf, size_t i)
{
    uint64_t v = 0;
    memcpy(&v, (const char *)buf + i * t->size, t->size);
    return v;
}

/* The expected result of one case, computed once from every contributor's
 * input and reused for the separate and the in-place run of that case. */
struct expect {
    /* key */
    const struct elem_type *t;
    enum op_kind op;
    enum pattern pat;
    size_t count;
    uint64_t seed;
    uint64_t group_hash;
    size_t lo_i, hi_i; /* the slice of elements this rank checks */
    /* deterministic cases: the exact result, typed */
    void *val;
    /* bounded cases: exact sum as hi + lo, and the allowed error */
    double *hi, *lo, *bound;
};

static struct expect cached;

static uint64_t group_hash(const struct group *g)
{
    return fnv1a(FNV_OFFSET + (uint64_t)g->n, g->world, sizeof(int) * (size_t)g->n);
}

static void expect_compute(const struct rcase *c, const struct group *g, struct expect *e)
{
    size_t lo_i = e->lo_i, hi_i = e->hi_i;
    int n = g->n;
    const struct elem_type *t = c->t;
    struct member *mem = malloc(sizeof *mem * (size_t)n);
    for (int j = 0; j < n; j++)
        mem[j] = member_make(c, g->world[j], j, n);
    size_t alloc = hi_i > lo_i ? hi_i - lo_i : 1;

    if (needs_bound(c)) {
        double eps = t->kind == EK_FLOAT ? FLT_EPSILON : DBL_EPSILON;
        double tiny = n * (t->kind == EK_FLOAT ? 0x1p-149 : 0x1p-1074);
        e->hi = malloc(alloc * sizeof(double));
        e->lo = malloc(alloc * sizeof(double));
        e->bound = malloc(alloc * sizeof(double));
        for (size_t i = lo_i; i < hi_i; i++) {
            /* Sum2 (Ogita-Rump-Oishi): hi + lo is the exact sum to ~2^-100
             * relative, far inside the bound below. */
            double s = 0, err = 0, abssum = 0;
            for (int j = 0; j < n; j++) {
                double x = float_value(c, &mem[j], i), d;
                two_sum(s, x, &s, &d);
                err += d;
                abssum += fabs(x);
            }
            e->hi[i - lo_i] = s;
            e->lo[i - lo_i] = err;
            /* What every ordered summation of n terms meets:
             * |fl(sum) - sum| <= (n-1) * u * sum|x| + O(u^2), u = eps/2. */
            e->bound[i - lo_i] = (n - 1) * eps * abssum + tiny;
        }
    } else {
        e->val = malloc(alloc * t->size);
        for (size_t i = lo_i; i < hi_i; i++) {
            if (t->is_float) {
                /* Exact in double for these patterns (dyadic, subnormal, powers
                 * of two, MAX/MIN, max-|x|); the cast to float is exact too. */
                double acc = float_value(c, &mem[0], i);
                for (int j = 1; j < n; j++)
                    acc = float_combine(c->op, acc, float_value(c, &mem[j], i));
                store_elem(t, e->val, i - lo_i, 0, acc);
            } else {
                uint64_t acc = int_value(c, &mem[0], i);
                for (int j = 1; j < n; j++)
                    acc = int_combine(c, acc, int_value(c, &mem[j], i));
                store_elem(t, e->val, i - lo_i, acc, 0.0);
            }
        }
    }
    free(mem);
}

/* Which elements this rank checks. All ranks' results are compared bitwise
 * (suite_verify_same), so checking a 1/n slice each still checks every
 * element, at O(count) instead of O(n * count) work per rank: that keeps the
 * 8-rank runs on 2 cores short. ERAR_TEST_FULL_CHECK=1 checks everything. */
static void check_slice(size_t count, int pos, int npos, size_t *lo, size_t *hi)
{
    static int full = -1;
    if (full < 0) {
        const char *v = getenv("ERAR_TEST_FULL_CHECK");
        full = v && *v && strcmp(v, "0") != 0;
    }
    if (full || count < 4096 || npos <= 1) {
        *lo = 0;
        *hi = count;
        return;
    }
    *lo = count / (size_t)npos * (size_t)pos;
    *hi = pos == npos - 1 ? count : count / (size_t)npos * (size_t)(pos + 1);
}

static const struct expect *expect_get(const struct rcase *c, const struct group *g, int pos, int npos)
{
    uint64_t gh = group_hash(g);
    size_t lo_i, hi_i;
    check_slice(c->count, pos, npos, &lo_i, &hi_i);
    struct expect *e = &cached;
    if (e->t == c->t && e->op == c->op && e->pat == c->pat && e->count == c->count &&
        e->seed == c->seed && e->group_hash == gh && e->lo_i == lo_i && e->hi_i == hi_i)
        return e;
    free(e->val);
    free(e->hi);
    free(e->lo);
    free(e->bound);
    *e = (struct expect){c->t, c->op, c->pat, c->count, c->seed, gh, lo_i, hi_i, NULL, NULL, NULL, NULL};
    expect_compute(c, g, e);
    return e;
}

/* Checks a result against the expectation. Returns false and describes the
 * first bad element. */
static bool check_result(const struct rcase *c, const struct group *g, int pos, int npos,
                         const void *res, char *msg, size_t len)
{
    const struct expect *e = expect_get(c, g, pos, npos);
    const struct elem_type *t = c->t;
    size_t lo_i = e->lo_i, hi_i = e->hi_i;
    if (e->val) {
        if (memcmp((const char *)res + lo_i * t->size, e->val, (hi_i - lo_i) * t->size) == 0)
            return true;
        for (size_t i = lo_i; i < hi_i; i++) {
            const char *want_p = (const char *)e->val + (i - lo_i) * t->size;
            if (!memcmp((const char *)res + i * t->size, want_p, t->size))
                continue;
            if (t->is_float) {
                double got = load_float(t, res, i), want = load_float(t, e->val, i - lo_i);
                if (isnan(got) && isnan(want))
                    continue; /* NaN payloads are unspecified */
                snprintf(msg, len, "element %zu: got %a expected %a (bitwise)", i, got, want);
            } else {
                snprintf(msg, len, "element %zu: got 0x%llx expected 0x%llx", i,
                         (unsigned long long)load_int(t, res, i),
                         (unsigned long long)load_int(t, e->val, i - lo_i));
            }
            return false;
        }
        return true;
    }
    for (size_t i = lo_i; i < hi_i; i++) {
        size_t k = i - lo_i;
        double got = load_float(t, res, i), dh, dl;
        two_sum(got, -e->hi[k], &dh, &dl);
        double diff = fabs(dh + (dl - e->lo[k]));
        if (!isfinite(got) || !(diff <= e->bound[k])) {
            snprintf(msg, len, "element %zu: got %a expected %a (error %.3g > bound %.3g) on %d ranks",
                     i, got, e->hi[k] + e->lo[k], diff, e->bound[k], g->n);
            return false;
        }
    }
    return true;
}

/* ------------------------------------------------------------ buffers */

#define GUARD 64

static unsigned char guard_byte(size_t j)
{
    return (unsigned char)(0xa5 ^ (j * 37));
}

void *gbuf_alloc(size_t bytes, size_t misalign)
{
    size_t total = GUARD + misalign + bytes + GUARD;
    unsigned char *base = aligned_alloc(64, (total + 63) & ~(size_t)63);
    if (!base) {
        fprintf(stderr, "out of memory (%zu bytes)\n", total);
        MPI_Abort(MPI_COMM_WORLD, 4);
    }
    unsigned char *p = base + GUARD + misalign;
    for (size_t j = 0; j < GUARD; j++) {
        p[-(ptrdiff_t)GUARD + (ptrdiff_t)j] = guard_byte(j);
        p[bytes + j] = guard_byte(j + GUARD);
    }
    return p;
}

bool gbuf_intact(const void *vp, size_t bytes)
{
    const unsigned char *p = vp;
    for (size_t j = 0; j < GUARD; j++)
        if (p[-(ptrdiff_t)GUARD + (ptrdiff_t)j] != guard_byte(j) || p[bytes + j] != guard_byte(j + GUARD))
            return false;
    return true;
}

void gbuf_free(void *p, size_t misalign)
{
    free((unsigned char *)p - GUARD - misalign);
}

/* ------------------------------------------------------------ groups */

void group_of(MPI_Comm comm, struct group *g)
{
    int inter = 0;
    MPI_Group grp, world;
    MPI_Comm_test_inter(comm, &inter);
    if (inter)
        MPI_Comm_remote_group(comm, &grp);
    else
        MPI_Comm_group(comm, &grp);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    MPI_Group_size(grp, &g->n);
    int *idx = malloc(sizeof(int) * (size_t)g->n);
    g->world = malloc(sizeof(int) * (size_t)g->n);
    for (int j = 0; j < g->n; j++)
        idx[j] = j;
    MPI_Group_translate_ranks(grp, g->n, idx, world, g->world);
    free(idx);
    MPI_Group_free(&grp);
    MPI_Group_free(&world);
}

void group_free(struct group *g)
{
    free(g->world);
    g->world = NULL;
}

/* ------------------------------------------------------------ suite */

void suite_init(struct suite *s, const char *name, int argc, char **argv)
{
    memset(s, 0, sizeof *s);
    s->name = name;
    s->digest = FNV_OFFSET;
    MPI_Comm_rank(MPI_COMM_WORLD, &s->world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &s->world_size);
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--quick") || !strcmp(argv[a], "-q")) {
            s->quick = true;
        } else {
            if (s->world_rank == 0)
                fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
}

void suite_fail(const struct suite *s, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "FAIL %s rank %d: %s\n", s->name, s->world_rank, buf);
    fflush(stderr);
    fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 1);
    abort(); /* MPI_Abort does not return; keeps noreturn honest */
}

static uint64_t canonical_hash(uint64_t h, const void *buf, size_t bytes, const struct elem_type *t)
{
    size_t n = t && t->is_float ? bytes / t->size : 0, i = 0;
    while (i < n && !isnan(load_float(t, buf, i)))
        i++;
    if (i == n)
        return fnv1a(h, buf, bytes);
    /* NaN payloads and signs are not specified by IEEE addition: hash a
     * canonical NaN instead (rare: only the Inf/NaN pattern has any). */
    unsigned char *copy = malloc(bytes);
    memcpy(copy, buf, bytes);
    for (; i < n; i++) {
        if (isnan(load_float(t, copy, i))) {
            if (t->kind == EK_FLOAT) {
                float q = NAN;
                memcpy(copy + 4 * i, &q, 4);
            } else {
                double q = NAN;
                memcpy(copy + 8 * i, &q, 8);
            }
        }
    }
    h = fnv1a(h, copy, bytes);
    free(copy);
    return h;
}

void suite_record(struct suite *s, const char *label, const void *buf, size_t bytes,
                  bool deterministic, const struct elem_type *t)
{
    if (s->npending == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->pending_hash = realloc(s->pending_hash, sizeof(uint64_t) * (size_t)s->cap);
        s->pending_label = realloc(s->pending_label, sizeof *s->pending_label * (size_t)s->cap);
    }
    s->pending_hash[s->npending] = fnv1a(FNV_OFFSET, buf, bytes);
    snprintf(s->pending_label[s->npending], sizeof s->pending_label[0], "%s", label);
    s->npending++;
    s->ncases++;
    if (deterministic && !s->no_digest) {
        s->digest = fnv1a(s->digest, label, strlen(label));
        s->digest = canonical_hash(s->digest, buf, bytes, t);
    }
}

void suite_verify_same(struct suite *s, MPI_Comm comm)
{
    int n, me;
    MPI_Comm_size(comm, &n);
    MPI_Comm_rank(comm, &me);
    /* Allgather, not Allreduce: the check must not go through the code it checks. */
    int *counts = malloc(sizeof(int) * (size_t)n);
    MPI_Allgather(&s->npending, 1, MPI_INT, counts, 1, MPI_INT, comm);
    for (int r = 0; r < n; r++)
        if (counts[r] != s->npending)
            suite_fail(s, "rank %d of comm recorded %d results, I recorded %d", r, counts[r], s->npending);
    uint64_t *all = malloc(sizeof(uint64_t) * (size_t)n * (size_t)(s->npending ? s->npending : 1));
    MPI_Allgather(s->pending_hash, s->npending * 8, MPI_BYTE, all, s->npending * 8, MPI_BYTE, comm);
    for (int r = 0; r < n; r++)
        for (int k = 0; k < s->npending; k++)
            if (all[(size_t)r * (size_t)s->npending + (size_t)k] != s->pending_hash[k])
                suite_fail(s, "%s: result differs between comm rank %d and comm rank %d (not bitwise identical)",
                           s->pending_label[k], me, r);
    free(all);
    free(counts);
    s->npending = 0;
}

int suite_finish(struct suite *s)
{
    MPI_Barrier(MPI_COMM_WORLD);
    if (s->world_rank == 0) {
        printf("DIGEST %016llx\n", (unsigned long long)s->digest);
        printf("PASS %s\n", s->name);
        fflush(stdout);
    }
    free(s->pending_hash);
    free(s->pending_label);
    ops_free();
    MPI_Finalize();
    return 0;
}

/* ------------------------------------------------------------ allreduce */

void rcase_label(const struct rcase *c, char *buf, size_t len)
{
    snprintf(buf, len, "allreduce type=%s op=%s pat=%s count=%zu %s comm=%s", c->t->name,
             op_name(c->op), pattern_name(c->pat), c->count, c->in_place ? "in_place" : "separate",
             c->comm_name);
}

void run_allreduce(struct suite *s, const struct rcase *c, MPI_Comm comm)
{
    char label[160], why[400];
    rcase_label(c, label, sizeof label);
    struct group contrib;
    group_of(comm, &contrib);
    int pos, npos;
    MPI_Comm_rank(comm, &pos);
    MPI_Comm_size(comm, &npos);

    size_t bytes = c->count * c->t->size;
    /* Alternate 64-byte-aligned and merely type-aligned buffers. */
    size_t mis = (s->ncases & 1) ? c->t->size : 0;
    void *send = gbuf_alloc(bytes, mis);
    size_t rmis = mis ? 0 : c->t->size;
    void *recv = gbuf_alloc(bytes, rmis);
    void *copy = malloc(bytes ? bytes : 1);
    struct member me = member_make(c, s->world_rank, pos, npos);
    fill_input(c, &me, send);
    memcpy(copy, send, bytes);

    int rc;
    if (c->in_place) {
        memcpy(recv, send, bytes);
        rc = MPI_Allreduce(MPI_IN_PLACE, recv, (int)c->count, c->t->dt, op_handle(c->op), comm);
    } else {
        memset(recv, 0xcd, bytes); /* stale garbage must not leak into the result */
        rc = MPI_Allreduce(send, recv, (int)c->count, c->t->dt, op_handle(c->op), comm);
    }
    if (rc != MPI_SUCCESS)
        suite_fail(s, "%s: MPI_Allreduce returned %d", label, rc);
    if (!gbuf_intact(send, bytes))
        suite_fail(s, "%s: bytes around the send buffer were overwritten", label);
    if (!gbuf_intact(recv, bytes))
        suite_fail(s, "%s: bytes around the receive buffer were overwritten", label);
    if (!c->in_place && memcmp(send, copy, bytes) != 0)
        suite_fail(s, "%s: the send buffer was modified", label);
    if (!check_result(c, &contrib, pos, npos, recv, why, sizeof why))
        suite_fail(s, "%s: %s", label, why);
    suite_record(s, label, recv, bytes, is_deterministic(c), c->t);

    free(copy);
    gbuf_free(send, mis);
    gbuf_free(recv, rmis);
    group_free(&contrib);
}

const char *mpi_error_class_name(int cls)
{
    switch (cls) {
    case MPI_SUCCESS: return "MPI_SUCCESS";
    case MPI_ERR_BUFFER: return "MPI_ERR_BUFFER";
    case MPI_ERR_COUNT: return "MPI_ERR_COUNT";
    case MPI_ERR_TYPE: return "MPI_ERR_TYPE";
    case MPI_ERR_TAG: return "MPI_ERR_TAG";
    case MPI_ERR_COMM: return "MPI_ERR_COMM";
    case MPI_ERR_RANK: return "MPI_ERR_RANK";
    case MPI_ERR_ROOT: return "MPI_ERR_ROOT";
    case MPI_ERR_GROUP: return "MPI_ERR_GROUP";
    case MPI_ERR_OP: return "MPI_ERR_OP";
    case MPI_ERR_ARG: return "MPI_ERR_ARG";
    case MPI_ERR_TRUNCATE: return "MPI_ERR_TRUNCATE";
    case MPI_ERR_INTERN: return "MPI_ERR_INTERN";
    case MPI_ERR_IN_STATUS: return "MPI_ERR_IN_STATUS";
    case MPI_ERR_PENDING: return "MPI_ERR_PENDING";
    case MPI_ERR_OTHER: return "MPI_ERR_OTHER";
    case MPI_ERR_UNKNOWN: return "MPI_ERR_UNKNOWN";
    default: return "(other class)";
    }
}
