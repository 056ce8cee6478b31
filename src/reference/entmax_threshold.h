// The reference's alpha-entmax threshold, shared by its entmax and Sieve.
#pragma once

#include <vector>

namespace winnow::reference {

// tau with sum_i [x_i - tau]_+^(1 / (alpha - 1)) = 1 for x = (alpha - 1) z over one row's
// visible keys; 0 for an empty row.
double entmax_threshold(std::vector<double> x, double alpha);

}  // namespace winnow::reference
