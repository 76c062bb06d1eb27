// xpm-plan strict CSV reader.
//
// The first non-blank line names the columns; cells are separated by commas and may be
// double-quoted ("" escapes a quote); blank lines are skipped; every row has as many cells as
// the header; numeric cells must parse completely as finite numbers. Extra columns are ignored
// by the verbs. Errors are InputError naming the file, the line and the column.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace xpm_plan {

struct CsvTable {
  std::string path;
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;  // one per data row, header.size() cells each
  std::vector<std::size_t> line_numbers;       // 1-based file line of each row

  /// Index of column `name`; InputError listing the columns when absent.
  std::size_t column(const std::string& name) const;
  /// Index of column `name`, or nullopt.
  std::optional<std::size_t> find_column(const std::string& name) const;
  /// The cell as a finite number; InputError naming file, line, column and cell otherwise.
  double number(std::size_t row, std::size_t col) const;
  /// The cell as a dim (a value of a formula variable): a finite number >= 0, and > 0 when
  /// `count` (the batch-size variable counts records). InputError otherwise, e.g.
  /// "predict: data.csv line 3, column l: -4 is negative; dims must be >= 0" (`verb` first).
  double dim(std::size_t row, std::size_t col, const std::string& verb, bool count) const;
  /// The cell as a boolean: 1/0, true/false, yes/no (any case); InputError otherwise.
  bool boolean(std::size_t row, std::size_t col) const;
  /// "FILE: line N, column 'C'" for messages.
  std::string where(std::size_t row, std::size_t col) const;
};

/// Reads and checks a CSV file; InputError when unreadable, empty, or malformed.
CsvTable read_csv(const std::string& path);
/// Parses CSV text; `path` names it in messages.
CsvTable parse_csv(const std::string& text, const std::string& path);

/// Quotes a cell when it holds a comma, a quote or a line break.
std::string csv_cell(const std::string& text);

}  // namespace xpm_plan
