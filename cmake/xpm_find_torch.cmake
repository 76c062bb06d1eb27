# xpm_find_torch(): finds the LibTorch inside the PyTorch 2.x of XPM_PYTHON_EXECUTABLE's
# environment (torch.utils.cmake_prefix_path), unless Torch_DIR already names one, and checks
# that its release lies in [XPM_TORCH_MIN_VERSION, XPM_TORCH_END_VERSION). Sets XPM_TORCH_VERSION
# and XPM_TORCH_PYTHON_VERSION (torch.__version__), and everything find_package(Torch) sets (TORCH_LIBRARIES, TORCH_INCLUDE_DIRS, ...).
function(_xpm_torch_fail why)
  message(FATAL_ERROR "xpm: ${why}")
endfunction()

# A CUDA build of torch: point CMake's FindCUDA (which TorchConfig.cmake uses) at the toolkit
# (CUDA_HOME, else /usr/local/cuda) and at the CUDA libraries of the nvidia-* wheels installed
# beside torch, which the toolkit may lack (NVRTC). CUDA 13 moved device_functions.h, by which
# CMake 3.25's FindCUDA finds the toolkit's headers, into include/crt/.
macro(_xpm_cuda_hints)
  set(_xpm_cuda_root $ENV{CUDA_HOME})
  if(NOT _xpm_cuda_root AND EXISTS /usr/local/cuda/include/cuda_runtime_api.h)
    set(_xpm_cuda_root /usr/local/cuda)
  endif()
  if(_xpm_cuda_root AND NOT CUDA_TOOLKIT_ROOT_DIR)
    set(CUDA_TOOLKIT_ROOT_DIR ${_xpm_cuda_root} CACHE PATH "CUDA toolkit of the CUDA parts")
    set(CUDA_TOOLKIT_INCLUDE ${_xpm_cuda_root}/include CACHE PATH "CUDA toolkit headers")
  endif()
  execute_process(
    COMMAND ${XPM_PYTHON_EXECUTABLE} -c
            "import glob, os, nvidia; print(';'.join(glob.glob(os.path.join(list(nvidia.__path__)[0], '*', 'lib'))))"
    OUTPUT_VARIABLE _xpm_nvidia_lib_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  string(REGEX MATCH "^[0-9]+" _xpm_cuda_major "${_xpm_torch_cuda}")
  find_library(CUDA_nvrtc_LIBRARY NAMES nvrtc libnvrtc.so.${_xpm_cuda_major}
               HINTS ${_xpm_cuda_root}/lib64 ${_xpm_nvidia_lib_dirs})
  # The NCCL process group's header (nccl.h) comes with the nvidia-nccl wheel, and LibTorch's
  # CUDA headers include the CUDA libraries' own (cusparse.h, cublas_v2.h), which a minimal
  # toolkit may lack and the nvidia-* wheels hold: XPM_CUDA_INCLUDE_DIRS.
  find_path(XPM_NCCL_INCLUDE_DIR nccl.h HINTS ${_xpm_cuda_root}/include ${_xpm_nvidia_lib_dirs}
            PATH_SUFFIXES ../include)
  set(XPM_CUDA_INCLUDE_DIRS "")
  foreach(_xpm_lib_dir IN LISTS _xpm_nvidia_lib_dirs)
    get_filename_component(_xpm_include_dir ${_xpm_lib_dir}/../include ABSOLUTE)
    if(IS_DIRECTORY ${_xpm_include_dir})
      list(APPEND XPM_CUDA_INCLUDE_DIRS ${_xpm_include_dir})
    endif()
  endforeach()
  # enable_language(CUDA) in TorchConfig.cmake defines CMAKE_CUDA_ARCHITECTURES, which torch
  # then warns it ignores (it uses TORCH_CUDA_ARCH_LIST); xpm compiles no CUDA code.
  if(POLICY CMP0104)
    cmake_policy(SET CMP0104 OLD)
  endif()
endmacro()

macro(xpm_find_torch)
  # torch.__version__ (e.g. 2.13.0+cpu) and torch.utils.cmake_prefix_path of the environment.
  execute_process(
    COMMAND ${XPM_PYTHON_EXECUTABLE} -c
            "import torch, torch.utils; print(torch.__version__); print(torch.utils.cmake_prefix_path); print(torch.version.cuda or '')"
    OUTPUT_VARIABLE _xpm_torch_query OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _xpm_torch_query_failed ERROR_QUIET)
  if(_xpm_torch_query_failed)
    if(SKBUILD)
      _xpm_torch_fail("${XPM_PYTHON_EXECUTABLE} cannot import torch: install torch ${XPM_TORCH_MIN_VERSION} to before ${XPM_TORCH_END_VERSION} first, then `pip install --no-build-isolation .` (xpm builds against the torch of the installing environment)")
    endif()
    _xpm_torch_fail("${XPM_PYTHON_EXECUTABLE} cannot import torch: run tools/setup.sh (it makes .venv/ with torch) or configure with -DXPM_PYTHON_EXECUTABLE=<python with torch ${XPM_TORCH_MIN_VERSION} to before ${XPM_TORCH_END_VERSION}>")
  endif()
  string(REPLACE "\n" ";" _xpm_torch_query "${_xpm_torch_query}")
  list(GET _xpm_torch_query 0 XPM_TORCH_PYTHON_VERSION)
  list(GET _xpm_torch_query 1 _xpm_torch_prefix)
  list(LENGTH _xpm_torch_query _xpm_torch_query_length)
  if(_xpm_torch_query_length GREATER 2)
    list(GET _xpm_torch_query 2 _xpm_torch_cuda)
    _xpm_cuda_hints()
  endif()
  if(NOT Torch_DIR OR Torch_DIR MATCHES "NOTFOUND")
    list(PREPEND CMAKE_PREFIX_PATH ${_xpm_torch_prefix})
  endif()
  # PyTorch's wheels link kineto (the profiler) into libtorch_cpu and ship no libkineto, so
  # TorchConfig.cmake warns "library kineto not found"; name the library that holds it.
  if(NOT kineto_LIBRARY)
    find_library(kineto_LIBRARY torch_cpu PATHS ${_xpm_torch_prefix}/../../lib ${Torch_DIR}/../../../lib NO_DEFAULT_PATH)
  endif()
  find_package(Torch REQUIRED)
  list(REMOVE_ITEM TORCH_LIBRARIES ${kineto_LIBRARY})  # linked through torch already
  set(XPM_TORCH_VERSION ${Torch_VERSION})
  if(XPM_TORCH_VERSION VERSION_LESS XPM_TORCH_MIN_VERSION OR
     NOT XPM_TORCH_VERSION VERSION_LESS XPM_TORCH_END_VERSION)
    _xpm_torch_fail("torch ${XPM_TORCH_VERSION} (${Torch_DIR}) is outside the supported range ${XPM_TORCH_MIN_VERSION} to before ${XPM_TORCH_END_VERSION}: install torch==2.13.0 in that environment or point XPM_PYTHON_EXECUTABLE at one that has it")
  endif()
  # torch 2.14's headers require C++20 (torch/all.h: "C++20 or later compatible compiler is
  # required"); earlier ones take C++17. What is compiled against LibTorch from here on (and an
  # embedder linking xpm::planner_torch) uses the standard the headers ask for.
  set(XPM_TORCH_CXX_STANDARD 17)
  foreach(_xpm_dir IN LISTS TORCH_INCLUDE_DIRS)
    if(EXISTS ${_xpm_dir}/torch/all.h)
      file(STRINGS ${_xpm_dir}/torch/all.h _xpm_cxx20 REGEX "C\\+\\+20 or later")
      if(_xpm_cxx20)
        set(XPM_TORCH_CXX_STANDARD 20)
      endif()
    endif()
  endforeach()
  set(CMAKE_CXX_STANDARD ${XPM_TORCH_CXX_STANDARD})
  message(STATUS "xpm: LibTorch of torch ${XPM_TORCH_VERSION} (${Torch_DIR}), C++${XPM_TORCH_CXX_STANDARD}")
endmacro()
