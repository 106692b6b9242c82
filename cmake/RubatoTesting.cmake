# rubato_add_test(NAME SOURCES a.cc b.cc LIBS lib1 lib2 [LABELS l1 l2])
# One GoogleTest executable registered with ctest; the working directory is the source root
# so tests find tests/data and models/ by relative path. Every executable ctest runs joins the
# target rubato_ctest_targets (rubato_ctest_target), which builds what ctest needs and nothing
# else: scripts/test's sanitizer builds skip the benchmarks and tools.
include(GoogleTest)
add_custom_target(rubato_ctest_targets)
function(rubato_ctest_target name)
  add_dependencies(rubato_ctest_targets ${name})
endfunction()
function(rubato_add_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  rubato_ctest_target(${name})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main
                        rubato_compile_options rubato_test_options)
  gtest_discover_tests(${name} WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
                       PROPERTIES LABELS "${ARG_LABELS}" DISCOVERY_TIMEOUT 60)
endfunction()
