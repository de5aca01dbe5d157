# Runs CMD (a ;-list) and passes only when it exits non-zero, within MAX_SECONDS, with output
# matching the regular expression EXPECT. Used for jobs that must die loudly (timeouts).
#   cmake -DCMD=... -DEXPECT=... -DMAX_SECONDS=... -P expect_failure.cmake
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT ${MAX_SECONDS})
string(TIMESTAMP t1 "%s")
math(EXPR elapsed "${t1} - ${t0}")
message("${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "expected a failing exit, got 0")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "output does not match: ${EXPECT}")
endif()
if(elapsed GREATER ${MAX_SECONDS})
  message(FATAL_ERROR "took ${elapsed} s > ${MAX_SECONDS} s")
endif()
message("ok: exit '${rc}' after ${elapsed} s")
