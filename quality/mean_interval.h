// The mean of per-sequence quality figures with a one-sided lower confidence bound: what kvtd's
// quality gate compares with its floor, so that a figure measured on few sequences cannot pass
// on its luck.
#pragma once

#include <optional>
#include <vector>

namespace kvt {

struct MeanInterval {
  int n = 0;
  double mean = 0;
  double sd = 0;  // sample standard deviation (n - 1); 0 when n < 2
  // Student-t one-sided 95% lower bound of the mean: mean - t(0.95, n - 1) * sd / sqrt(n).
  // Absent when n < 2 (one sequence says nothing about the spread).
  std::optional<double> lower95;
};

// Over `values` (one figure per held-out sequence; the sequences are the independent units).
MeanInterval MeanWithLowerBound(const std::vector<double>& values);

// The 0.95 quantile of Student's t with `dof` >= 1 degrees of freedom: exact to 3 decimals from
// a table up to 30, then the Cornish-Fisher expansion around the normal quantile (error < 1e-4
// there). Hand-written because no dependency the project has ships a t quantile, and pulling in
// Boost.Math for one number is not worth it.
double StudentT95(int dof);

}  // namespace kvt
