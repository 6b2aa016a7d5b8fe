# FindNcclByVersion: choose the NCCL to compile and link against by version, not by search path.
#
# Why not find_library(nccl): the GPU machine carries two NCCLs, the pip `nvidia-nccl-cu13` that
# torch loads and an older Debian one in /usr that a bare `-lnccl` picks silently. The device API
# structs differ between versions, so the header we compile with must match the libnccl.so.2 the
# process loads, which is torch's. Candidates, first acceptable one wins:
#   1. $EP_NCCL_ROOT_DIR (or -DEP_NCCL_ROOT_DIR=...)
#   2. the pip package nvidia-nccl-cu13 of ${Python_EXECUTABLE}
#   3. $CUDA_HOME
#   4. /usr/local/cuda
# A candidate is accepted when include/nccl.h reports a version >= the requested one, include/
# nccl_device.h exists and a libnccl.so.2 sits in lib64/, lib/ or targets/x86_64-linux/lib/.
#
# Usage: find_package(NcclByVersion 2.28 REQUIRED) after Python_EXECUTABLE is known.
# Sets EP_NCCL_ROOT, EP_NCCL_INCLUDE_DIR, EP_NCCL_LIBRARY (full path of libnccl.so.2),
# EP_NCCL_LIBRARY_DIR, EP_NCCL_VERSION ("2.28.9"), EP_NCCL_VERSION_CODE (22809), and
# NcclByVersion_FOUND.

if(NcclByVersion_FIND_VERSION)
  set(_ep_nccl_min_version "${NcclByVersion_FIND_VERSION}")
else()
  set(_ep_nccl_min_version "2.28")
endif()

set(_ep_nccl_candidates "")
set(_ep_nccl_origins "")

macro(_ep_nccl_add_candidate root origin)
  if(NOT "${root}" STREQUAL "")
    list(APPEND _ep_nccl_candidates "${root}")
    list(APPEND _ep_nccl_origins "${origin}")
  endif()
endmacro()

if(DEFINED EP_NCCL_ROOT_DIR AND NOT "${EP_NCCL_ROOT_DIR}" STREQUAL "")
  _ep_nccl_add_candidate("${EP_NCCL_ROOT_DIR}" "-DEP_NCCL_ROOT_DIR")
elseif(DEFINED ENV{EP_NCCL_ROOT_DIR} AND NOT "$ENV{EP_NCCL_ROOT_DIR}" STREQUAL "")
  _ep_nccl_add_candidate("$ENV{EP_NCCL_ROOT_DIR}" "env EP_NCCL_ROOT_DIR")
endif()

if(Python_EXECUTABLE)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_LIST_DIR}/pip_nccl_root.py"
    OUTPUT_VARIABLE _ep_nccl_pip_root
    ERROR_QUIET
    RESULT_VARIABLE _ep_nccl_pip_result
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_ep_nccl_pip_result EQUAL 0 AND NOT "${_ep_nccl_pip_root}" STREQUAL "")
    _ep_nccl_add_candidate("${_ep_nccl_pip_root}" "pip nvidia-nccl-cu13 of ${Python_EXECUTABLE}")
  else()
    _ep_nccl_add_candidate("<none>" "pip nvidia-nccl-cu13: not installed for ${Python_EXECUTABLE}")
  endif()
else()
  _ep_nccl_add_candidate("<none>" "pip nvidia-nccl-cu13: not looked at (Python_EXECUTABLE unset)")
endif()

if(DEFINED ENV{CUDA_HOME} AND NOT "$ENV{CUDA_HOME}" STREQUAL "")
  _ep_nccl_add_candidate("$ENV{CUDA_HOME}" "CUDA_HOME")
endif()
_ep_nccl_add_candidate("/usr/local/cuda" "default CUDA location")

set(_ep_nccl_report "")
set(_ep_nccl_seen "")
set(EP_NCCL_ROOT "")
list(LENGTH _ep_nccl_candidates _ep_nccl_count)
if(_ep_nccl_count GREATER 0)
  math(EXPR _ep_nccl_last "${_ep_nccl_count} - 1")
  foreach(_ep_i RANGE ${_ep_nccl_last})
    list(GET _ep_nccl_candidates ${_ep_i} _ep_root)
    list(GET _ep_nccl_origins ${_ep_i} _ep_origin)
    if("${_ep_root}" STREQUAL "<none>")  # a source that gave no directory: only report it
      string(APPEND _ep_nccl_report "  ${_ep_origin}\n")
      continue()
    endif()
    get_filename_component(_ep_real "${_ep_root}" REALPATH)
    if("${_ep_real}" IN_LIST _ep_nccl_seen)
      continue()
    endif()
    list(APPEND _ep_nccl_seen "${_ep_real}")

    set(_ep_header "${_ep_root}/include/nccl.h")
    if(NOT EXISTS "${_ep_header}")
      string(APPEND _ep_nccl_report "  ${_ep_root} (${_ep_origin}): missing include/nccl.h\n")
      continue()
    endif()

    file(STRINGS "${_ep_header}" _ep_defines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
    set(_ep_version_parts "")
    foreach(_ep_part MAJOR MINOR PATCH)
      set(_ep_value "")
      foreach(_ep_line IN LISTS _ep_defines)
        if(_ep_line MATCHES "^#define NCCL_${_ep_part} +([0-9]+)")
          set(_ep_value "${CMAKE_MATCH_1}")
        endif()
      endforeach()
      list(APPEND _ep_version_parts "${_ep_value}")
    endforeach()
    list(GET _ep_version_parts 0 _ep_major)
    list(GET _ep_version_parts 1 _ep_minor)
    list(GET _ep_version_parts 2 _ep_patch)
    if("${_ep_major}" STREQUAL "" OR "${_ep_minor}" STREQUAL "" OR "${_ep_patch}" STREQUAL "")
      string(APPEND _ep_nccl_report "  ${_ep_root} (${_ep_origin}): no NCCL_MAJOR/MINOR/PATCH in include/nccl.h\n")
      continue()
    endif()
    set(_ep_version "${_ep_major}.${_ep_minor}.${_ep_patch}")
    if(_ep_version VERSION_LESS _ep_nccl_min_version)
      string(APPEND _ep_nccl_report
             "  ${_ep_root} (${_ep_origin}): version ${_ep_version} < ${_ep_nccl_min_version}\n")
      continue()
    endif()
    if(NOT EXISTS "${_ep_root}/include/nccl_device.h")
      string(APPEND _ep_nccl_report "  ${_ep_root} (${_ep_origin}): version ${_ep_version}, no include/nccl_device.h\n")
      continue()
    endif()

    set(_ep_library "")
    foreach(_ep_libdir lib64 lib targets/x86_64-linux/lib)
      if(EXISTS "${_ep_root}/${_ep_libdir}/libnccl.so.2")
        set(_ep_library "${_ep_root}/${_ep_libdir}/libnccl.so.2")
        break()
      endif()
    endforeach()
    if("${_ep_library}" STREQUAL "")
      string(APPEND _ep_nccl_report
             "  ${_ep_root} (${_ep_origin}): version ${_ep_version}, no libnccl.so.2 in lib64/, lib/ or "
             "targets/x86_64-linux/lib/\n")
      continue()
    endif()

    set(EP_NCCL_ROOT "${_ep_root}")
    set(EP_NCCL_INCLUDE_DIR "${_ep_root}/include")
    set(EP_NCCL_LIBRARY "${_ep_library}")
    get_filename_component(EP_NCCL_LIBRARY_DIR "${_ep_library}" DIRECTORY)
    set(EP_NCCL_VERSION "${_ep_version}")
    # NCCL >= 2.9 encodes versions as major * 10000 + minor * 100 + patch.
    math(EXPR EP_NCCL_VERSION_CODE "${_ep_major} * 10000 + ${_ep_minor} * 100 + ${_ep_patch}")
    set(_ep_nccl_chosen_origin "${_ep_origin}")
    break()
  endforeach()
endif()

if(NOT "${EP_NCCL_ROOT}" STREQUAL "")
  set(NcclByVersion_FOUND TRUE)
  set(NcclByVersion_VERSION "${EP_NCCL_VERSION}")
  if(NOT NcclByVersion_FIND_QUIETLY)
    message(STATUS "deep_ep: NCCL ${EP_NCCL_VERSION} from ${EP_NCCL_ROOT} (${_ep_nccl_chosen_origin})")
    message(STATUS "deep_ep: linking ${EP_NCCL_LIBRARY}")
  endif()
  if(NOT "${_ep_nccl_report}" STREQUAL "" AND NOT NcclByVersion_FIND_QUIETLY)
    message(STATUS "deep_ep: NCCL candidates passed over before it:\n${_ep_nccl_report}")
  endif()
else()
  set(NcclByVersion_FOUND FALSE)
  string(CONCAT _ep_nccl_message
      "deep_ep needs NCCL >= ${_ep_nccl_min_version} with include/nccl_device.h and libnccl.so.2. "
      "Candidates looked at, in order:\n${_ep_nccl_report}"
      "Install the pip package (pip install nvidia-nccl-cu13) into the Python given by "
      "-DPython_EXECUTABLE, or point EP_NCCL_ROOT_DIR at an NCCL install (include/ and lib/).")
  if(NcclByVersion_FIND_REQUIRED)
    message(FATAL_ERROR "${_ep_nccl_message}")
  elseif(NOT NcclByVersion_FIND_QUIETLY)
    message(WARNING "${_ep_nccl_message}")
  endif()
endif()
