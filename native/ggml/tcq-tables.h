// tcq3_64 / tcq2_64 / tcq25_64 / tcq35_64 level tables (in 1/4096), in one place for the reference (tcq.c) and the CPU kernels
// (cpu/tcq-cpu.c): trained by scripts/tcq_tables.py on Gaussian blocks, each scaled to unit RMS as the encoder
// scales them, alternating the Viterbi paths with a least-squares fit of A and B. A value's level is
// A[s >> 4] + B[s & 15]: two lookups of 16, which SIMD decoders take with byte shuffles of the levels' low and
// high bytes. The lists are X-macros so that those byte tables are constants too (a row's read builds nothing).
#pragma once

#include <stdint.h>

#define TCQ3_A(X) X(  354) X(-4187) X(-4449) X(  504) X(-1710) X( 3336) X( 1481) X(-7124) \
                  X(-2373) X( -771) X( 2696) X( 5536) X( -620) X( 1846) X( 6706) X(-2411)
#define TCQ3_B(X) X(-4845) X( 1112) X( 2426) X(-2751) X( -769) X(  539) X( 3647) X(-1898) \
                  X( 1858) X( -318) X( 4712) X(-3977) X(-1802) X(  832) X( 3421) X(-2188)
#define TCQ2_A(X) X( 2008) X(-4882) X( 2839) X(-2797) X(-1357) X( 1043) X(-6090) X( 6235) \
                  X( 5043) X(  962) X(  305) X( -113) X(-3288) X(-2157) X(  220) X( 2979)
#define TCQ2_B(X) X(  933) X( 2483) X(-2738) X(-5195) X( 4052) X(-1380) X(-1332) X( 1487) \
                  X( -991) X( 4290) X( 1273) X(-3988) X(  345) X( -368) X( 4341) X(-3213)

// tcq25_64: its even values' (3-bit steps) tables, then its odd values' (2-bit steps), trained together
#define TCQ25_A3(X) X( 3196) X(-5611) X( 1048) X(-2035) X( -788) X( 1185) X(-5480) X( 5265) \
                    X( 6343) X(  242) X(  901) X( 3265) X(-3876) X(-2032) X(-1886) X( 1664)
#define TCQ25_B3(X) X( -111) X( 2888) X(-2664) X(-5549) X( 3494) X( -609) X(-3367) X( 1462) \
                    X(-1338) X( 5302) X( 1151) X(-1839) X( -698) X( 1522) X( 3740) X(-3384)
#define TCQ25_A2(X) X(-5669) X( 1310) X( 3975) X(  -84) X( 2907) X( 2140) X(  659) X( 4370) \
                    X(  173) X(-2328) X(-2159) X( 2346) X(-1466) X( 6215) X(-4335) X(-2033)
#define TCQ25_B2(X) X( -525) X( 1093) X(-4629) X( 4090) X( 5911) X(  700) X(-1778) X( 2765) \
                    X(-4014) X( 2552) X(  573) X(-2219) X(-5629) X(  -49) X(-1808) X( 2967)

// tcq35_64: its even values' (4-bit steps) tables, then its odd values' (3-bit steps)
#define TCQ35_A4(X) X( 2633) X(-4669) X( -510) X(-2422) X(  338) X( -628) X(-6672) X( 6218) \
                    X( 3957) X(-1037) X(  508) X( 1875) X(-1940) X(-3117) X( 1622) X( 1103)
#define TCQ35_B4(X) X( -125) X( 2289) X(-2114) X(-4572) X( 4312) X(-1195) X(  292) X( 1027) \
                    X(-1461) X( 5288) X(  -90) X(-5253) X( 1390) X(  347) X( 2808) X(-2943)
#define TCQ35_A3(X) X(-5415) X(  727) X( 4287) X( 1932) X( 2463) X( -359) X( 1031) X( 5514) \
                    X( -337) X(-1825) X(-1585) X(  641) X(  887) X( 3089) X(-2906) X(-2413)
#define TCQ35_B3(X) X(-1106) X(  906) X(-1567) X( 2995) X( 4150) X( 1534) X( -391) X( 6581) \
                    X(-6332) X(  281) X( -467) X(-2429) X(-4218) X(  375) X(-2746) X( 2435)

#define TCQ_LEVEL(v) (int16_t) (v),
#define TCQ_LO(v)    (uint8_t) ((uint16_t) (int16_t) (v) & 0xFF),
#define TCQ_HI(v)    (uint8_t) ((uint16_t) (int16_t) (v) >> 8),
