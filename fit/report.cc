#include "fit/report.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace kvt {
namespace fit {
namespace {

std::string Escape(const std::string& text) {
  return absl::StrReplaceAll(text, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"},
                                    {"\"", "&quot;"}});
}

std::optional<double> Field(const LayerEntry& layer, R2Field field) {
  switch (field) {
    case R2Field::kK: return layer.r2_k;
    case R2Field::kV: return layer.r2_v;
    case R2Field::kKHeldout: return layer.r2_k_heldout;
    case R2Field::kVHeldout: return layer.r2_v_heldout;
  }
  return std::nullopt;
}

std::string Format(std::optional<double> value) {
  return value.has_value() ? absl::StrFormat("%.4f", *value) : "&ndash;";
}

// Viridis-like ramp (5 anchors, linear between): dark blue for 0, yellow for 1.
std::string Colour(double value) {
  static const double kAnchors[5][3] = {
      {68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  const double t = std::clamp(std::isfinite(value) ? value : 0.0, 0.0, 1.0) * 4;
  const int i = std::min(3, static_cast<int>(t));
  const double f = t - i;
  int rgb[3];
  for (int c = 0; c < 3; ++c) {
    rgb[c] = static_cast<int>(kAnchors[i][c] + f * (kAnchors[i + 1][c] - kAnchors[i][c]) + 0.5);
  }
  return absl::StrFormat("#%02x%02x%02x", rgb[0], rgb[1], rgb[2]);
}

// Heatmap: rows are source layers (0 at the top), columns target layers. Chosen sources
// (sigma_k) are outlined. Each cell's <title> shows the exact value on hover.
std::string Heatmap(const std::string& title, const std::vector<double>& table, int ls, int lt,
                    const Manifest& manifest) {
  const int cell = std::clamp(560 / std::max(ls, lt), 6, 28);
  const int left = 40, top = 28, bottom = 30, bar = 40;
  const int width = left + lt * cell + bar + 40, height = top + ls * cell + bottom;
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n<text x=\"%d\" y=\"16\" "
      "font-weight=\"bold\">%s</text>\n",
      width, height, left, Escape(title));
  std::set<std::pair<int, int>> chosen;
  for (size_t l = 0; l < manifest.layers.size(); ++l) {
    for (int j : manifest.layers[l].sigma_k) chosen.insert({j, static_cast<int>(l)});
  }
  for (int j = 0; j < ls; ++j) {
    for (int l = 0; l < lt; ++l) {
      const double value = table[j * lt + l];
      absl::StrAppendFormat(&svg,
                            "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\"%s>"
                            "<title>source %d -> target %d: R^2 %.4f%s</title></rect>\n",
                            left + l * cell, top + j * cell, cell, cell, Colour(value),
                            chosen.count({j, l}) ? " stroke=\"#ff2020\" stroke-width=\"1.5\"" : "",
                            j, l, value, chosen.count({j, l}) ? " (chosen)" : "");
    }
  }
  const int label_every = std::max(1, 16 / cell + 1);
  for (int j = 0; j < ls; j += label_every) {
    absl::StrAppendFormat(&svg, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%d</text>\n",
                          left - 4, top + j * cell + cell / 2 + 4, j);
  }
  for (int l = 0; l < lt; l += label_every) {
    absl::StrAppendFormat(&svg, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%d</text>\n",
                          left + l * cell + cell / 2, top + ls * cell + 13, l);
  }
  absl::StrAppendFormat(&svg,
                        "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">target layer</text>\n"
                        "<text x=\"12\" y=\"%d\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 12 %d)\">source layer</text>\n",
                        left + lt * cell / 2, top + ls * cell + 26, top + ls * cell / 2,
                        top + ls * cell / 2);
  // Colour bar, 1 at the top.
  const int bx = left + lt * cell + 14, bh = ls * cell;
  for (int i = 0; i < 50; ++i) {
    absl::StrAppendFormat(&svg, "<rect x=\"%d\" y=\"%.2f\" width=\"12\" height=\"%.2f\" "
                          "fill=\"%s\"/>\n", bx, top + bh * i / 50.0, bh / 50.0 + 0.5,
                          Colour(1.0 - (i + 0.5) / 50));
  }
  absl::StrAppendFormat(&svg, "<text x=\"%d\" y=\"%d\">1</text><text x=\"%d\" y=\"%d\">0</text>\n",
                        bx + 15, top + 9, bx + 15, top + bh);
  svg += "</svg>\n";
  return svg;
}

}  // namespace

std::optional<double> MeanR2(const Manifest& manifest, R2Field field, bool skip_layer0) {
  double sum = 0;
  int count = 0;
  for (const LayerEntry& layer : manifest.layers) {
    if (skip_layer0 && layer.target_layer == 0) continue;
    std::optional<double> value = Field(layer, field);
    if (!value.has_value()) continue;
    sum += *value;
    ++count;
  }
  if (count == 0) return std::nullopt;
  return sum / count;
}

std::string RenderReport(const ReportData& data) {
  const Manifest& m = data.manifest;
  std::string html = absl::StrCat(
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>kvt fit: ",
      Escape(data.mapper_id),
      "</title>\n<style>body{font-family:sans-serif;margin:2em;max-width:1400px}"
      "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 8px;"
      "text-align:right}th{background:#eee}td.l{text-align:left}.warn{color:#a40}"
      ".maps{display:flex;flex-wrap:wrap;gap:2em}</style></head><body>\n<h1>kvt fit: ",
      Escape(data.mapper_id), "</h1>\n<p>", Escape(m.source.name), " (", m.source.num_layers,
      " layers x ", m.source.num_kv_heads, " KV heads x ", m.source.head_dim, ") &rarr; ",
      Escape(m.target.name), " (", m.target.num_layers, " x ", m.target.num_kv_heads, " x ",
      m.target.head_dim, "), k = ", m.k, ", lambda = ", FormatDouble(m.lambda), " (",
      LambdaScaleName(m.lambda_scale), " scale)</p>\n");

  html += "<h2>Summary</h2>\n<table><tr><th></th><th>K in-sample</th><th>V in-sample</th>"
          "<th>K held-out</th><th>V held-out</th></tr>\n";
  for (bool skip : {false, true}) {
    absl::StrAppend(&html, "<tr><td class=\"l\">", skip ? "mean R^2 without layer 0" : "mean R^2",
                    "</td>");
    for (R2Field f : {R2Field::kK, R2Field::kV, R2Field::kKHeldout, R2Field::kVHeldout}) {
      absl::StrAppend(&html, "<td>", Format(MeanR2(m, f, skip)), "</td>");
    }
    html += "</tr>\n";
  }
  html += "</table>\n";
  if (m.quality.attention_cosine_heldout || m.quality.attention_cosine_heldout_all_layers) {
    absl::StrAppend(
        &html,
        "<table><tr><th></th><th>without layer 0</th><th>all layers</th></tr>\n<tr><td "
        "class=\"l\">held-out attention-output cosine</td><td>",
        Format(m.quality.attention_cosine_heldout), "</td><td>",
        Format(m.quality.attention_cosine_heldout_all_layers),
        "</td></tr>\n</table>\n<p>The target's causal attention output over the translated K/V "
        "(the mapper as served: written weights, CPU backend) against its output over its own "
        "K/V, with its own queries, on the held-out sequences (SPEC 5): the paper's best "
        "predictor of downstream retention, and what kvtd's prefix-cache gate reads "
        "(manifest <code>quality.attention_cosine_heldout</code>).</p>\n");
  }
  html += "<p>Held-out sequences are never used to choose layers or fit weights: "
          "the held-out column is the honest one. Target layer 0 sees no attention, so any "
          "source predicts it well; the row without it is the informative average. R^2 says "
          "how much variance the map explains, not whether the target model still works with "
          "the translated cache: judge a mapper by the target's downstream quality, and next to "
          "a token-identity control.</p>\n";

  if (!data.warnings.empty()) {
    html += "<h2>Warnings</h2>\n<ul>\n";
    for (const std::string& w : data.warnings) {
      absl::StrAppend(&html, "<li class=\"warn\">", Escape(w), "</li>\n");
    }
    html += "</ul>\n";
  }

  html += "<h2>Single-layer probe R^2</h2>\n<p>Each cell: head-averaged R^2 of one target layer "
          "regressed on one source layer (SPEC 4.2; ";
  html += (m.source.num_kv_heads == m.target.num_kv_heads &&
           m.source.head_dim == m.target.head_dim)
              ? "head h on head h"
              : "shapes differ: each target head on the whole source layer";
  html += "), in-sample on the training split. Outlined cells are the chosen sources.</p>\n"
          "<div class=\"maps\">\n";
  const int ls = data.probe.source_layers, lt = data.probe.target_layers;
  if (ls > 0 && lt > 0) {
    html += Heatmap("K (RoPE stripped)", data.probe.r2_k, ls, lt, m);
    html += Heatmap("V", data.probe.r2_v, ls, lt, m);
  }
  html += "</div>\n";

  html += "<h2>Per target layer</h2>\n<table><tr><th>target layer</th><th class=\"l\">sigma "
          "(descending probe score)</th><th>K in-sample</th><th>V in-sample</th>"
          "<th>K held-out</th><th>V held-out</th><th>attention cosine held-out</th>"
          "<th>best single-layer score</th></tr>\n";
  for (const LayerEntry& layer : m.layers) {
    std::optional<double> best;
    if (!layer.sigma_k.empty() && ls > 0) best = data.probe.score(layer.sigma_k[0], layer.target_layer);
    absl::StrAppend(&html, "<tr><td>", layer.target_layer, "</td><td class=\"l\">",
                    absl::StrJoin(layer.sigma_k, ", "),
                    layer.sigma_v != layer.sigma_k
                        ? absl::StrCat(" (V: ", absl::StrJoin(layer.sigma_v, ", "), ")")
                        : "",
                    "</td><td>", Format(layer.r2_k), "</td><td>", Format(layer.r2_v),
                    "</td><td>", Format(layer.r2_k_heldout), "</td><td>",
                    Format(layer.r2_v_heldout), "</td><td>",
                    Format(layer.attention_cosine_heldout), "</td><td>", Format(best),
                    "</td></tr>\n");
  }
  html += "</table>\n<h2>Calibration</h2>\n<table>\n";
  for (const auto& [key, value] : data.facts) {
    absl::StrAppend(&html, "<tr><td class=\"l\">", Escape(key), "</td><td class=\"l\">",
                    Escape(value), "</td></tr>\n");
  }
  html += "</table>\n</body></html>\n";
  return html;
}

}  // namespace fit
}  // namespace kvt
