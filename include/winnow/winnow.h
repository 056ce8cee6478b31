// Everything a C++ caller needs: include this one header and link winnow::winnow.
#pragma once

#include "winnow/adamw.h"
#include "winnow/attention.h"
#include "winnow/cross_entropy.h"
#include "winnow/decode.h"
#include "winnow/entmax.h"
#include "winnow/error.h"
#include "winnow/rms_norm.h"
#include "winnow/rotary.h"
#include "winnow/screening.h"
#include "winnow/sieve.h"
#include "winnow/softmax.h"
#include "winnow/stick_breaking.h"
#include "winnow/swiglu.h"
#include "winnow/tensor.h"
#include "winnow/threshold.h"
