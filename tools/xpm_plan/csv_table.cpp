// xpm-plan strict CSV reader (see csv_table.hpp).
#include "csv_table.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <sstream>
#include <string_view>

#include "common.hpp"

namespace xpm_plan {

std::optional<std::size_t> CsvTable::find_column(const std::string& name) const {
  auto it = std::find(header.begin(), header.end(), name);
  if (it == header.end()) return std::nullopt;
  return static_cast<std::size_t>(it - header.begin());
}

std::size_t CsvTable::column(const std::string& name) const {
  if (auto c = find_column(name)) return *c;
  std::string names;
  for (const auto& h : header) names += (names.empty() ? "" : ", ") + h;
  throw InputError(path + ": no column '" + name + "' (columns: " + names + ")");
}

std::string CsvTable::where(std::size_t row, std::size_t col) const {
  return path + ": line " + std::to_string(line_numbers[row]) + ", column '" + header[col] + "'";
}

double CsvTable::number(std::size_t row, std::size_t col) const {
  const std::string& cell = rows[row][col];
  double value = 0;
  const char* end = cell.data() + cell.size();
  auto [ptr, ec] = std::from_chars(cell.data(), end, value);
  if (cell.empty() || ec != std::errc() || ptr != end || !std::isfinite(value)) {
    throw InputError(where(row, col) + ": '" + cell + "' is not a finite number");
  }
  return value;
}

double CsvTable::dim(std::size_t row, std::size_t col, const std::string& verb,
                     bool count) const {
  const std::string& cell = rows[row][col];
  const std::string where =
      verb + ": " + path + " line " + std::to_string(line_numbers[row]) + ", column " + header[col];
  double value = 0;
  const char* end = cell.data() + cell.size();
  auto [ptr, ec] = std::from_chars(cell.data(), end, value);
  if (cell.empty() || ec != std::errc() || ptr != end) {
    throw InputError(where + ": '" + cell + "' is not a number; dims must be finite numbers >= 0");
  }
  const std::string problem = dim_problem(value, cell, header[col], count);
  if (!problem.empty()) throw InputError(where + ": " + problem);
  return value;
}

bool CsvTable::boolean(std::size_t row, std::size_t col) const {
  std::string cell = rows[row][col];
  std::transform(cell.begin(), cell.end(), cell.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (cell == "1" || cell == "true" || cell == "yes") return true;
  if (cell == "0" || cell == "false" || cell == "no") return false;
  throw InputError(where(row, col) + ": '" + rows[row][col] +
                   "' is not a boolean (1/0, true/false, yes/no)");
}

namespace {

std::vector<std::string> split_csv_line(const std::string& line, const std::string& path,
                                        std::size_t line_number) {
  std::vector<std::string> cells;
  std::size_t i = 0;
  while (true) {
    std::string cell;
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    if (i < line.size() && line[i] == '"') {
      ++i;
      bool closed = false;
      while (i < line.size()) {
        if (line[i] == '"') {
          if (i + 1 < line.size() && line[i + 1] == '"') {
            cell += '"';
            i += 2;
            continue;
          }
          ++i;
          closed = true;
          break;
        }
        cell += line[i++];
      }
      if (!closed) {
        throw InputError(path + ": line " + std::to_string(line_number) +
                         ": unterminated quoted cell");
      }
      while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
      if (i < line.size() && line[i] != ',') {
        throw InputError(path + ": line " + std::to_string(line_number) +
                         ": unexpected text after a quoted cell");
      }
    } else {
      const std::size_t comma = line.find(',', i);
      const std::size_t stop = comma == std::string::npos ? line.size() : comma;
      cell = trim(line.substr(i, stop - i));
      i = stop;
    }
    cells.push_back(std::move(cell));
    if (i >= line.size()) break;
    ++i;  // skip the comma; a trailing comma yields a final empty cell
    if (i == line.size()) {
      cells.emplace_back();
      break;
    }
  }
  return cells;
}

}  // namespace

CsvTable parse_csv(const std::string& text, const std::string& path) {
  // A UTF-8 byte-order mark (spreadsheets write one) is not part of the first column's name.
  const std::string_view bom = "\xEF\xBB\xBF";
  std::istringstream in(text.compare(0, bom.size(), bom) == 0 ? text.substr(bom.size()) : text);
  CsvTable table;
  table.path = path;
  std::string line;
  std::size_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (trim(line).empty()) continue;
    std::vector<std::string> cells = split_csv_line(line, path, line_number);
    if (table.header.empty()) {
      for (const auto& name : cells) {
        if (name.empty()) {
          throw InputError(path + ": line " + std::to_string(line_number) +
                           ": empty column name in the header");
        }
        if (std::count(cells.begin(), cells.end(), name) > 1) {
          throw InputError(path + ": line " + std::to_string(line_number) + ": column '" + name +
                           "' appears twice in the header");
        }
      }
      table.header = std::move(cells);
      continue;
    }
    if (cells.size() != table.header.size()) {
      throw InputError(path + ": line " + std::to_string(line_number) + " has " +
                       std::to_string(cells.size()) + " cells, the header has " +
                       std::to_string(table.header.size()));
    }
    table.rows.push_back(std::move(cells));
    table.line_numbers.push_back(line_number);
  }
  if (table.header.empty()) throw InputError(path + ": empty CSV file (no header row)");
  if (table.rows.empty()) throw InputError(path + ": no data rows after the header");
  return table;
}

CsvTable read_csv(const std::string& path) {
  return parse_csv(read_file(path, "CSV file"), path);
}

std::string csv_cell(const std::string& text) {
  if (text.find_first_of(",\"\r\n") == std::string::npos) return text;
  std::string out = "\"";
  for (char c : text) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

}  // namespace xpm_plan
