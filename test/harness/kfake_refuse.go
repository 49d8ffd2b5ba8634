package harness

import (
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// RefuseCreateTopics makes the cluster answer every CreateTopics request
// with TOPIC_AUTHORIZATION_FAILED, as a broker does for a user without
// Create, until the cluster closes.
func RefuseCreateTopics(c *kfake.Cluster) {
	c.ControlKey(int16(kmsg.CreateTopics), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		create := req.(*kmsg.CreateTopicsRequest)
		resp := create.ResponseKind().(*kmsg.CreateTopicsResponse)
		for _, topic := range create.Topics {
			rt := kmsg.NewCreateTopicsResponseTopic()
			rt.Topic = topic.Topic
			rt.ErrorCode = kerr.TopicAuthorizationFailed.Code
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
}
