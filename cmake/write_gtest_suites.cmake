# Writes a CTest file with one test per GoogleTest suite of TEST_EXECUTABLE (its tests in one
# process), except the suites in SPLIT_SUITES, which get one test per test. Run after each build
# of the executable (tests/CMakeLists.txt, for winnow_model_tests), like gtest_discover_tests.
# Why: the model tests link LibTorch, whose start-up costs about a second per process; a process
# per test spent over a third of the CI machine's test time starting up.
#   -D TEST_EXECUTABLE= -D CTEST_FILE= -D WORKING_DIR= -D LABELS= -D TIMEOUT= -D SPLIT_SUITES=a,b
cmake_minimum_required(VERSION 3.25)
string(REPLACE "," ";" SPLIT_SUITES "${SPLIT_SUITES}")
execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
                RESULT_VARIABLE rc OUTPUT_VARIABLE listing ERROR_VARIABLE errors)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} --gtest_list_tests failed (${rc}): ${errors}")
endif()
# Parameterized tests end in "  # GetParam() = ...", which may hold ';' or brackets: drop it.
string(REGEX REPLACE "[ ]+#[^\n]*" "" listing "${listing}")
string(REPLACE ";" "" listing "${listing}")
string(REPLACE "\n" ";" lines "${listing}")
set(content "")
set(suite "")
set(count 0)
# One CTest test `name` running the executable's tests that `filter` selects.
macro(add_gtest name filter)
  string(APPEND content "add_test([=[${name}]=] \"${TEST_EXECUTABLE}\" [=[--gtest_filter=${filter}]=])\n")
  string(APPEND content "set_tests_properties([=[${name}]=] PROPERTIES LABELS \"${LABELS}\" TIMEOUT ${TIMEOUT} WORKING_DIRECTORY \"${WORKING_DIR}\")\n")
  math(EXPR count "${count} + 1")
endmacro()
foreach(line IN LISTS lines)
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.")  # a suite line: "Suite." (parameterized: "Prefix/Suite.")
    set(suite "${CMAKE_MATCH_1}")
    if(NOT suite IN_LIST SPLIT_SUITES)
      add_gtest("${suite}" "${suite}.*")
    endif()
  elseif(line MATCHES "^  ([A-Za-z0-9_/]+)" AND suite IN_LIST SPLIT_SUITES)
    add_gtest("${suite}.${CMAKE_MATCH_1}" "${suite}.${CMAKE_MATCH_1}")
  endif()
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} lists no tests")
endif()
file(WRITE "${CTEST_FILE}" "${content}")
