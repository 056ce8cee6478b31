# The installed CMake package as a C++ user meets it: install the build into a fresh prefix,
# configure examples/cpp_attention against it with find_package(winnow), build and run it;
# with TORCH_DIR (a build with the LibTorch operators), also install component torch and do the
# same for examples/torch_attention with find_package(winnow COMPONENTS torch).
# cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... [-DTORCH_DIR=...] -P check_package.cmake
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_package.cmake: pass -D${var}=...")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix" --component winnow)
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/examples/cpp_attention" -B "${WORK_DIR}/example"
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build "${WORK_DIR}/example")
run("${WORK_DIR}/example/cpp_attention")

if(TORCH_DIR)
  run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix" --component torch)
  run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/examples/torch_attention" -B "${WORK_DIR}/torch_example"
      "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" "-DTorch_DIR=${TORCH_DIR}" -DCMAKE_BUILD_TYPE=Release)
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/torch_example")
  run("${WORK_DIR}/torch_example/torch_attention")
endif()
