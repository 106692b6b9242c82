# rubato_add_test(NAME SOURCES a.cc b.cc LIBS lib1 lib2 [LABELS l1 l2])
# One GoogleTest executable registered with ctest; the working directory is the source root
# so tests find tests/data and models/ by relative path. Every executable ctest runs joins the
# target rubato_ctest_targets (rubato_ctest_target), which builds what ctest needs and nothing
# else: scripts/test's sanitizer builds skip the benchmarks and tools.
include(GoogleTest)
add_custom_target(rubato_ctest_targets)

# RUBATO_TEST_PCH (scripts/test and scripts/tsan set it): every test executable reuses one
# precompiled header, GoogleTest and the standard headers most tests include beyond it, made by
# rubato_test_pch (an empty object library with the tests' flags). Parsing those headers was
# about a fifth of a test file's compile time (docs/testing.md). GCC checks that the PCH fits
# each test (-Winvalid-pch, an error under RUBATO_WERROR). Off by default: the PCH could hide a
# test's missing #include of one of its headers, and clang 14's tools (clangd, clang-tidy)
# cannot read the GCC .gch that compile_commands.json then points them to.
if(RUBATO_TEST_PCH)
  file(CONFIGURE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/rubato_test_pch.cc
       CONTENT "// Empty: the target rubato_test_pch exists for its precompiled header.\n")
  add_library(rubato_test_pch OBJECT ${CMAKE_CURRENT_BINARY_DIR}/rubato_test_pch.cc)
  target_link_libraries(rubato_test_pch PRIVATE GTest::gtest rubato_compile_options
                        rubato_test_options)
  target_precompile_headers(rubato_test_pch PRIVATE <gtest/gtest.h> <algorithm> <cmath>
                            <cstring> <numeric> <span>)
endif()

function(rubato_ctest_target name)
  add_dependencies(rubato_ctest_targets ${name})
endfunction()
function(rubato_add_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  rubato_ctest_target(${name})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main
                        rubato_compile_options rubato_test_options)
  if(RUBATO_TEST_PCH)
    target_precompile_headers(${name} REUSE_FROM rubato_test_pch)
  endif()
  gtest_discover_tests(${name} WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
                       PROPERTIES LABELS "${ARG_LABELS}" DISCOVERY_TIMEOUT 60)
endfunction()
