package protocol

import (
	"fmt"
	"testing"

	"github.com/IBM/sarama"
)

// Partition picks what sarama's murmur2 partitioner picks (and so the Java
// client), for keys of every length mod 4, binary keys and several counts.
func TestPartitionMatchesSaramaMurmur2(t *testing.T) {
	keys := [][]byte{{}, {0}, {0xff}, []byte("a"), []byte("ab"), []byte("abc"), []byte("abcd"), []byte("order-42"),
		{0x80, 0x00, 0xff, 0x7f, 0x01}}
	for i := range 500 {
		keys = append(keys, fmt.Appendf(nil, "key-%d-%x", i, i*7919))
	}
	for _, n := range []int32{1, 2, 3, 4, 7, 64, 1000} {
		p := sarama.NewMurmur2Partitioner("t")
		for _, k := range keys {
			want, err := p.Partition(&sarama.ProducerMessage{Key: sarama.ByteEncoder(k)}, n)
			if err != nil {
				t.Fatal(err)
			}
			if got := Partition(k, n); got != want {
				t.Fatalf("Partition(%q, %d) = %d, sarama's murmur2 partitioner says %d", k, n, got, want)
			}
		}
	}
}

// The Java client's own test vectors for Utils.murmur2.
func TestMurmur2JavaVectors(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want int32
	}{
		{"21", -973932308},
		{"foobar", -790332482},
		{"a-little-bit-long-string", -985981536},
		{"a-little-bit-longer-string", -1486304829},
		{"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971},
		{"abc", 479470107},
	} {
		if got := murmur2([]byte(tt.in)); got != tt.want {
			t.Errorf("murmur2(%q) = %d, want %d", tt.in, got, tt.want)
		}
	}
}
