package operate

import (
	"strings"
	"testing"
)

func TestGlobToLike(t *testing.T) {
	tests := []struct {
		glob, like, err string
	}{
		{glob: "payments.retry", like: "payments.retry"},
		{glob: "payments.*", like: "payments.%"},
		{glob: "*", like: "%"},
		{glob: "pay?ments", like: "pay_ments"},
		{glob: "pay_ments.*", like: `pay\_ments.%`},
		{glob: "100%", like: `100\%`},
		{glob: `a\*b`, like: "a*b"},
		{glob: `a\\b`, like: `a\\b`},
		{glob: `a\_b`, like: `a\_b`},
		{glob: "a[bc]", err: "character classes"},
		{glob: `a\`, err: "not a valid pattern"},
		{glob: "a[", err: "not a valid pattern"},
	}
	for _, tt := range tests {
		t.Run(tt.glob, func(t *testing.T) {
			like, err := GlobToLike(tt.glob)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Errorf("GlobToLike(%q) = %q, %v; want an error with %q", tt.glob, like, err, tt.err)
				}
				return
			}
			if err != nil || like != tt.like {
				t.Errorf("GlobToLike(%q) = %q, %v; want %q", tt.glob, like, err, tt.like)
			}
		})
	}
}
