-- A number as Redis should store it: every digit a double has (scores, tags, clocks).
local function num(x)
  return string.format('%.17g', x)
end
