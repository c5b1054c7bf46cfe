/* rng.c: the counter-based random stream behind dropout and initialisation.
 *
 * Draw idx of stream (seed, counter) is a pure function of the three numbers
 * (SplitMix64's finaliser over a keyed counter), so a dropout mask never
 * depends on how many threads computed it or in which order. */
#include "internal.h"

uint64_t mha_stream_key(uint64_t seed, uint64_t counter)
{
    uint64_t c = mha_stream_bits(0x6a09e667f3bcc909ULL, counter);
    return mha_stream_bits(seed ^ c, 0);
}

double mha_dropout_uniform(uint64_t seed, uint64_t counter, uint64_t idx)
{
    return mha_stream_uniform(mha_stream_key(seed, counter), idx);
}
