# Third-party libraries: Debian's packages where installed (tools/install-deps.sh), otherwise
# copies in WINNOW_DEPS_DIR (tools/prepare_gpu_deps.sh fills one for machines that cannot
# install packages, such as the GPU machines).
set(WINNOW_DEPS_DIR "" CACHE PATH "Folder with eigen3/, CLI11/, nlohmann/ headers and googletest/ sources")

function(winnow_header_only target package include_probe folder)
  if(TARGET ${target})
    return()
  endif()
  if(WINNOW_DEPS_DIR AND EXISTS "${WINNOW_DEPS_DIR}/${folder}/${include_probe}")
    add_library(${target} INTERFACE IMPORTED GLOBAL)
    set_target_properties(${target} PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${WINNOW_DEPS_DIR}/${folder}")
    message(STATUS "winnow: ${package} from ${WINNOW_DEPS_DIR}/${folder}")
  else()
    message(FATAL_ERROR "winnow needs ${package}: run tools/install-deps.sh, or set "
                        "WINNOW_DEPS_DIR to a folder made by tools/prepare_gpu_deps.sh")
  endif()
endfunction()

find_package(Eigen3 3.4 QUIET NO_MODULE)
winnow_header_only(Eigen3::Eigen Eigen3 Eigen/Core eigen3)

find_package(CLI11 QUIET)
winnow_header_only(CLI11::CLI11 CLI11 CLI/CLI.hpp CLI11)

find_package(nlohmann_json 3 QUIET)
winnow_header_only(nlohmann_json::nlohmann_json nlohmann_json nlohmann/json.hpp json)

if(WINNOW_BUILD_TESTS)
  find_package(GTest QUIET)
  if(NOT TARGET GTest::gtest_main)
    if(WINNOW_DEPS_DIR AND EXISTS "${WINNOW_DEPS_DIR}/googletest/CMakeLists.txt")
      set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
      set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
      add_subdirectory("${WINNOW_DEPS_DIR}/googletest" "${CMAKE_BINARY_DIR}/googletest" EXCLUDE_FROM_ALL)
      if(NOT TARGET GTest::gtest_main)  # GoogleTest >= 1.11 defines these itself
        add_library(GTest::gtest_main ALIAS gtest_main)
        add_library(GTest::gtest ALIAS gtest)
      endif()
      message(STATUS "winnow: GoogleTest built from ${WINNOW_DEPS_DIR}/googletest")
    else()
      message(FATAL_ERROR "winnow's tests need GoogleTest: run tools/install-deps.sh, or set "
                          "WINNOW_DEPS_DIR (tools/prepare_gpu_deps.sh)")
    endif()
  endif()
endif()
