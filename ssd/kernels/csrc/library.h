// SSD_LIBRARY(m): the kernel's ops in its torch library namespace SSD_NS (build.py's -D, one
// per kernel and build). TORCH_LIBRARY pastes and stringises its namespace argument, and older
// torch releases (2.9 among them) do so without expanding it: the ops would land in a namespace
// literally named "SSD_NS". One more level of macro expands it first.
#pragma once

#include <torch/library.h>

#define SSD_LIBRARY_IN(ns, m) TORCH_LIBRARY(ns, m)
#define SSD_LIBRARY(m) SSD_LIBRARY_IN(SSD_NS, m)
