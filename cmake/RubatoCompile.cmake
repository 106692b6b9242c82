# Warnings and sanitizers shared by every rubato C++ target.
add_library(rubato_compile_options INTERFACE)
target_compile_options(rubato_compile_options INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${RUBATO_WERROR}>>:-Werror>)
target_include_directories(rubato_compile_options INTERFACE ${PROJECT_SOURCE_DIR})

# The test executables' own sources (not the libraries they test) also get
# RUBATO_TEST_CXX_FLAGS, after the build type's: scripts/test builds them at -O0 (38 % less
# compile time than -O2; what they test keeps the build's level).
set(RUBATO_TEST_CXX_FLAGS "" CACHE STRING "Extra C++ flags of the test executables' sources")
separate_arguments(rubato_test_cxx_flags UNIX_COMMAND "${RUBATO_TEST_CXX_FLAGS}")
add_library(rubato_test_options INTERFACE)
target_compile_options(rubato_test_options INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:${rubato_test_cxx_flags}>)

if(RUBATO_SANITIZE)
  if(NOT RUBATO_SANITIZE MATCHES "^(address,undefined|undefined,address|address|undefined|thread)$")
    message(FATAL_ERROR "RUBATO_SANITIZE='${RUBATO_SANITIZE}': expected address,undefined or thread")
  endif()
  set(RUBATO_SANITIZE_FLAGS -fsanitize=${RUBATO_SANITIZE} -fno-omit-frame-pointer)
  if(RUBATO_SANITIZE MATCHES "undefined")
    list(APPEND RUBATO_SANITIZE_FLAGS -fno-sanitize-recover=undefined)
  endif()
  if(RUBATO_SANITIZE STREQUAL "thread" AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # Boost.Asio's std::atomic_thread_fence, which TSan does not model, warns in every unit.
    list(APPEND RUBATO_SANITIZE_FLAGS -Wno-tsan)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${RUBATO_SANITIZE_FLAGS}>")
  add_link_options(${RUBATO_SANITIZE_FLAGS})
endif()

# RUBATO_FUZZ: every target gets libFuzzer's coverage instrumentation and ASan + UBSan (a
# finding in a library must show up in the fuzzer that reached it); only the fuzzers of
# tests/fuzz link libFuzzer's main (-fsanitize=fuzzer there).
if(RUBATO_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "RUBATO_FUZZ=ON needs clang for libFuzzer (CXX=clang++-14, as "
                        "scripts/fuzz sets it); the compiler is ${CMAKE_CXX_COMPILER_ID}")
  endif()
  if(RUBATO_SANITIZE)
    message(FATAL_ERROR "RUBATO_FUZZ=ON brings its own sanitizers (address,undefined): "
                        "leave RUBATO_SANITIZE empty")
  endif()
  set(RUBATO_FUZZ_FLAGS -fsanitize=fuzzer-no-link,address,undefined
      -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${RUBATO_FUZZ_FLAGS}>")
  add_link_options(-fsanitize=address,undefined)
endif()
