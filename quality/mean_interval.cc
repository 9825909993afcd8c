#include "quality/mean_interval.h"

#include <cmath>

namespace kvt {

double StudentT95(int dof) {
  static constexpr double kTable[31] = {
      0,     6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
      1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
      1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697};
  if (dof < 1) return std::nan("");
  if (dof <= 30) return kTable[dof];
  const double z = 1.6448536269514722, v = dof;
  const double z3 = z * z * z, z5 = z3 * z * z;
  return z + (z3 + z) / (4 * v) + (5 * z5 + 16 * z3 + 3 * z) / (96 * v * v);
}

MeanInterval MeanWithLowerBound(const std::vector<double>& values) {
  MeanInterval out;
  out.n = static_cast<int>(values.size());
  if (out.n == 0) return out;
  double sum = 0;
  for (double v : values) sum += v;
  out.mean = sum / out.n;
  if (out.n < 2) return out;
  double squares = 0;
  for (double v : values) squares += (v - out.mean) * (v - out.mean);
  out.sd = std::sqrt(squares / (out.n - 1));
  out.lower95 = out.mean - StudentT95(out.n - 1) * out.sd / std::sqrt(static_cast<double>(out.n));
  return out;
}

}  // namespace kvt
