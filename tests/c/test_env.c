/* test_env.c - the MTC_* variable parsers (csrc/env.c): whole values only,
 * ranges, booleans and words, and one recorded problem per variable. */
#include "env.h"

#include "check.h"

#include <string.h>

static int _problems(char *last, size_t cap)
{
    int n = 0;
    while (mtc_env_take_problem(last, cap)) n++;
    return n;
}

int main(void)
{
    char msg[512];
    int64_t v = -7;
    mtc_env_id cap = MTC_ENV_PINNED_CAP_BYTES;

    unsetenv("MTC_PINNED_CAP_BYTES");
    CHECK_EQ(mtc_env_int(cap, &v), 0);
    CHECK_EQ(v, -7);
    setenv("MTC_PINNED_CAP_BYTES", "   ", 1); /* blank: unset */
    CHECK_EQ(mtc_env_int(cap, &v), 0);
    setenv("MTC_PINNED_CAP_BYTES", " 4096\n", 1);
    CHECK_EQ(mtc_env_int(cap, &v), 1);
    CHECK_EQ(v, 4096);
    setenv("MTC_PINNED_CAP_BYTES", "9223372036854775807", 1);
    CHECK_EQ(mtc_env_int(cap, &v), 1);
    CHECK_EQ(v, INT64_MAX);
    CHECK_EQ(_problems(msg, sizeof msg), 0);

    /* never half-read: each is refused whole, v untouched */
    const char *bad[] = {"1e99", "512MB", "0", "-5", "+5", "0x10", "9223372036854775808", "12 34", "1.5", "",
                         "99999999999999999999999999999999999999999999999999999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        if (!*bad[i]) continue;
        v = -7;
        setenv("MTC_PINNED_CAP_BYTES", bad[i], 1);
        CHECK_EQ(mtc_env_int(cap, &v), -1);
        CHECK_EQ(v, -7);
    }
    /* one problem for the variable, the first refused value, taken once */
    CHECK_EQ(_problems(msg, sizeof msg), 1);
    CHECK(strstr(msg, "MTC_PINNED_CAP_BYTES='1e99'") != NULL);
    CHECK(strstr(msg, "not an integer from 1 to 9223372036854775807") != NULL);
    CHECK(strstr(msg, "default cap (1 GiB) is used") != NULL);
    CHECK_EQ(_problems(msg, sizeof msg), 0);

    /* ranges: MTC_H2D_RING takes 0 .. 64 */
    setenv("MTC_H2D_RING", "64", 1);
    CHECK_EQ(mtc_env_int(MTC_ENV_H2D_RING, &v), 1);
    CHECK_EQ(v, 64);
    setenv("MTC_H2D_RING", "65", 1);
    CHECK_EQ(mtc_env_int(MTC_ENV_H2D_RING, &v), -1);
    CHECK_EQ(_problems(msg, sizeof msg), 1);
    CHECK(strstr(msg, "MTC_H2D_RING='65' is not an integer from 0 to 64") != NULL);

    /* booleans */
    const char *yes[] = {"1", "true", "YES", " on "}, *no[] = {"0", "False", "no", "OFF"};
    for (int i = 0; i < 4; i++) {
        setenv("MTC_SLAB_HUGEPAGES", yes[i], 1);
        CHECK_EQ(mtc_env_bool(MTC_ENV_SLAB_HUGEPAGES, 0), 1);
        setenv("MTC_SLAB_HUGEPAGES", no[i], 1);
        CHECK_EQ(mtc_env_bool(MTC_ENV_SLAB_HUGEPAGES, 1), 0);
    }
    setenv("MTC_SLAB_HUGEPAGES", "10", 1); /* once read as 1 from its first character */
    CHECK_EQ(mtc_env_bool(MTC_ENV_SLAB_HUGEPAGES, 0), 0);
    CHECK_EQ(mtc_env_bool(MTC_ENV_SLAB_HUGEPAGES, 1), 1);
    CHECK_EQ(_problems(msg, sizeof msg), 1);
    CHECK(strstr(msg, "MTC_SLAB_HUGEPAGES='10' is not a boolean") != NULL);
    unsetenv("MTC_SLAB_HUGEPAGES");
    CHECK_EQ(mtc_env_bool(MTC_ENV_SLAB_HUGEPAGES, 1), 1);

    /* words */
    setenv("MTC_FILE_READER", "uring", 1);
    CHECK_EQ(mtc_env_enum(MTC_ENV_FILE_READER, -1), 1);
    setenv("MTC_FILE_READER", "pread", 1);
    CHECK_EQ(mtc_env_enum(MTC_ENV_FILE_READER, -1), 0);
    setenv("MTC_FILE_READER", "preadx", 1);
    CHECK_EQ(mtc_env_enum(MTC_ENV_FILE_READER, -1), -1);
    CHECK_EQ(_problems(msg, sizeof msg), 1);
    CHECK(strstr(msg, "MTC_FILE_READER='preadx' is not one of 'pread', 'uring'") != NULL);

    /* unprintable bytes are escaped in the message, long values cut */
    setenv("MTC_ARENA_POPULATE", "\x01yes", 1);
    CHECK_EQ(mtc_env_bool(MTC_ENV_ARENA_POPULATE, 0), 0);
    CHECK_EQ(_problems(msg, sizeof msg), 1);
    CHECK(strstr(msg, "MTC_ARENA_POPULATE='\\x01yes'") != NULL);

    /* check_all records every variable set to a refused value */
    for (int i = 0; i < MTC_ENV_COUNT; i++) setenv(mtc_env_name((mtc_env_id)i), "bogus", 1);
    mtc_env_check_all();
    /* those already reported above are not reported again */
    CHECK_EQ(_problems(msg, sizeof msg), MTC_ENV_COUNT - 5);
    printf("test_env: all passed (%ld checks)\n", atomic_load(&g_checks));
    return 0;
}
