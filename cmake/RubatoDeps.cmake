# Third-party dependencies, all from Debian/Ubuntu packages (scripts/setup installs them).
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)
find_package(yaml-cpp REQUIRED)
find_package(spdlog REQUIRED)
find_package(fmt REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)

# yaml-cpp 0.7 (Debian 12) exports `yaml-cpp`; 0.8 (Ubuntu 24.04) exports `yaml-cpp::yaml-cpp`.
if(TARGET yaml-cpp::yaml-cpp)
  set(RUBATO_YAML_TARGET yaml-cpp::yaml-cpp)
else()
  set(RUBATO_YAML_TARGET yaml-cpp)
endif()

pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
# Metrics: prometheus-cpp's core (registry, families, text serializer; Debian prometheus-cpp-dev).
# pkg-config, not its CMake package, which also requires the pull and push parts' civetweb, zlib
# and curl: the exposition is served on rubato's own HTTP listeners, and the GPU machine gets
# only the core (scripts/gpu/fetch-build-deps).
pkg_check_modules(PROMETHEUS_CPP REQUIRED IMPORTED_TARGET prometheus-cpp-core)

# CBLAS: OpenBLAS (pkg-config `openblas`, Debian libopenblas-dev).
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
find_path(RUBATO_CBLAS_INCLUDE_DIR cblas.h
  HINTS ${OPENBLAS_INCLUDE_DIRS} PATH_SUFFIXES openblas x86_64-linux-gnu REQUIRED)
add_library(rubato_cblas INTERFACE)
target_include_directories(rubato_cblas SYSTEM INTERFACE ${RUBATO_CBLAS_INCLUDE_DIR})
target_link_libraries(rubato_cblas INTERFACE PkgConfig::OPENBLAS)

if(RUBATO_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

# ---- control and data planes (transport/, cache_rank/) ------------------------------------
# Protobuf schemas (common/proto) and Boost.Asio (header-only in Boost >= 1.69) for the RPC.
find_package(Protobuf REQUIRED)
if(NOT Protobuf_PROTOC_EXECUTABLE)
  message(FATAL_ERROR "protoc not found (Debian: protobuf-compiler)")
endif()
find_package(Boost 1.74 REQUIRED)

# RUBATO_UCX / RUBATO_MPI = AUTO|ON|OFF: AUTO builds the backend when its development files are
# found (the GPU machines have UCX's libraries but not its headers: AUTO turns it off there).
foreach(option RUBATO_UCX RUBATO_MPI)
  if(NOT ${option} MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "${option}='${${option}}': expected AUTO, ON or OFF")
  endif()
endforeach()

set(RUBATO_UCX_ENABLED OFF)
if(NOT RUBATO_UCX STREQUAL "OFF")
  pkg_check_modules(UCX IMPORTED_TARGET ucx)
  if(UCX_FOUND)
    set(RUBATO_UCX_ENABLED ON)
  elseif(RUBATO_UCX STREQUAL "ON")
    message(FATAL_ERROR "RUBATO_UCX=ON but UCX (pkg-config ucx, Debian libucx-dev) was not found")
  endif()
endif()

set(RUBATO_MPI_ENABLED OFF)
if(NOT RUBATO_MPI STREQUAL "OFF")
  find_package(MPI COMPONENTS C)
  if(MPI_C_FOUND)
    set(RUBATO_MPI_ENABLED ON)
  elseif(RUBATO_MPI STREQUAL "ON")
    message(FATAL_ERROR "RUBATO_MPI=ON but MPI (Debian libopenmpi-dev) was not found")
  endif()
endif()
