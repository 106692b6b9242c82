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
