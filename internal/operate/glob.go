package operate

import (
	"errors"
	"fmt"
	"path"
	"strings"
)

// GlobToLike translates a path.Match-style glob into a LIKE pattern, so
// that the CLI and the console filter target topics and error classes the
// same way: * is %, ? is _, \ quotes the next character, and LIKE's own
// % _ and \ are escaped. Character classes have no LIKE equivalent and are
// refused; topic names cannot contain brackets anyway.
func GlobToLike(glob string) (string, error) {
	if _, err := path.Match(glob, ""); err != nil {
		return "", fmt.Errorf("not a valid pattern: %w", err)
	}
	var b strings.Builder
	for i := 0; i < len(glob); i++ {
		c := glob[i]
		switch c {
		case '*':
			b.WriteByte('%')
			continue
		case '?':
			b.WriteByte('_')
			continue
		case '[':
			return "", errors.New("character classes [...] are not supported: use * and ?")
		case '\\':
			i++
			if i == len(glob) {
				return "", errors.New(`ends in \: nothing to quote`)
			}
			c = glob[i]
		}
		if c == '%' || c == '_' || c == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(c)
	}
	return b.String(), nil
}
